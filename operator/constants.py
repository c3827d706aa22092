"""Names of the LLMService API the operator serves."""

GROUP = "iterserve.io"
VERSION = "v1alpha1"
KIND = "LLMService"
PLURAL = "llmservices"
SHORT_NAME = "llmsvc"
# Where the operator's pods run and the labels they carry (manifests/): the admin port's only clients.
DEFAULT_OPERATOR_NAMESPACE = "iterserve-system"
DEFAULT_OPERATOR_LABELS = {"app.kubernetes.io/name": "iterserve-operator"}
# Pods' /metrics the tuners scrape at once across every service (`iterserve operator --max-concurrent-scrapes`):
# fewer than the operator's background threads (handlers.BACKGROUND_THREADS), so scrapes queued behind hung
# pods leave threads to the resync passes.
DEFAULT_MAX_CONCURRENT_SCRAPES = 16
