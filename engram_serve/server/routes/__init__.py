"""The endpoints, by family; each module's `register(app, ctx)` adds its routes to the app."""
