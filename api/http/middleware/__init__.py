"""Request middleware: API key, body size limit, request metrics."""
