"""Helpers the tests share (no tests here): real server processes, tiny models, clients."""
