"""The service core, which knows no protocol: built from the settings, it loads the models,
starts their runners, caches, admission, adapters and cascade, classifies, and drains. The
doors (HTTP in api.http, the split's socket, the batch commands) only translate."""
