"""The HTTP reward server behind ``python -m rlhf.serve_rm`` (its flags and the behaviour: rlhf/serve_rm.py):
scoring.py (the model), app.py (the ASGI app and wire format), server.py (uvicorn and the socket)."""
