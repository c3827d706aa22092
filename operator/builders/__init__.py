"""Pure functions that render the Kubernetes objects of one LLMService (no API calls here)."""
