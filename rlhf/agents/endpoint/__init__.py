"""An OpenAI-compatible endpoint inside the job, with sessions stitched into training samples (issue 44 item 3).

sessions.py (recording and stitching), protocol.py (OpenAI's wire format), tool_turns.py (tool_calls replies and their
turns rendered back as the model wrote them), hub.py (engines, session routing, the
thread hand-off), server.py (FastAPI + uvicorn on a thread), executor.py (run_agent files and OpenRLHF's
openai-server executor as executors).  fastapi / uvicorn / openai are imported only when an endpoint starts."""
