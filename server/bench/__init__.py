"""`iterserve bench`: load generator and latency report for any OpenAI-compatible server."""
