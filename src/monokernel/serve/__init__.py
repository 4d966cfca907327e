"""``monokernel serve``: an OpenAI-compatible HTTP server over one Engine, with a playground.

FastAPI and uvicorn are imported only inside this package (``pip install ".[serve]"``), so
``import monokernel`` works without them.
"""
