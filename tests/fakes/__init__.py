"""Fakes of things outside the project (an OpenAI-compatible server)."""
