"""Names of the LLMService API the operator serves."""

GROUP = "iterserve.io"
VERSION = "v1alpha1"
KIND = "LLMService"
PLURAL = "llmservices"
SHORT_NAME = "llmsvc"
