"""The OpenAI-compatible server: scheduler.py (jobs, settings, the shared Scheduler), static.py and
continuous.py (the two scheduling loops), http.py (the FastAPI app and `serve`)."""
