"""Following one request: its id, the log lines it writes, and its trace."""
