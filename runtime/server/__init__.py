"""The HTTP server: app, OpenAI serving, protocol, admin routes, metrics, errors, `kvpilot serve`."""
