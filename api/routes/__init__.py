"""HTTP route modules, one per resource; `api.app.create_app` includes their routers."""
