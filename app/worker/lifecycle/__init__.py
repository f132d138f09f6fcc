"""app/worker/lifecycle."""
