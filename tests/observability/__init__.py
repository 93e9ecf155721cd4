"""api.observability: one request followed through its id, logs and trace."""
