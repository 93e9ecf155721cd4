"""Everything that knows HTTP: the app, its routes, contracts, errors and middleware."""
