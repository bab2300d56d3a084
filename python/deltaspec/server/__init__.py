"""`deltaspec serve`: an OpenAI-compatible HTTP server (chat and text completions, SSE streaming,
/v1/models, /health, /metrics) on Starlette + uvicorn.

One thread owns the Model and steps it (`engine_loop`); requests join and leave the running batch
every step (`backend`, the only module that calls the engine's request API); HTTP handlers
(`app`) validate (`schemas`), submit, and relay text deltas as they come (`text`).
Importing this package loads nothing heavy; `app` imports Starlette.
"""
