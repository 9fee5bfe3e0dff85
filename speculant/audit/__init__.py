"""The lossless audit: speculative output compared with plain decoding of the same request, in a running server
(server/bridge/auditor.py) or offline over a recorded log (`speculant audit`, cli.py)."""

from speculant.audit.rules import Difference, first_difference, lossy_settings, plain_params, sampled, skip_reason

__all__ = ["Difference", "first_difference", "lossy_settings", "plain_params", "sampled", "skip_reason"]
