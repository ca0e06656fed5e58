"""The web console at /console (docs/console.md): server-rendered pages over the same control layer
as the API, signed in with an API key."""
