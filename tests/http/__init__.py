"""api.http: the app, its routes, middleware, auth, the Open Inference Protocol, the split."""
