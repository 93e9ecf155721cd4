"""The front-end/model split: HTTP in front-end processes (`loraserve front-end`), the models
in the service process (`loraserve` with SPLIT_SOCKET), one Unix socket between them."""
