"""Names of the LLMService API the operator serves."""

GROUP = "iterserve.io"
VERSION = "v1alpha1"
KIND = "LLMService"
PLURAL = "llmservices"
SHORT_NAME = "llmsvc"
# Where the operator's pods run and the labels they carry (manifests/): the admin port's only clients.
DEFAULT_OPERATOR_NAMESPACE = "iterserve-system"
DEFAULT_OPERATOR_LABELS = {"app.kubernetes.io/name": "iterserve-operator"}
