"""`python old_rule_ab.py bench …`: speculant bench where a draft proposer named pchain0.301 runs the p_chain rule
of commit 2022d26 (0.3, checked after the draft pass, on the drawn tokens' probabilities times the likeliest next
token's), so the old rule and the new run side by side in one interleaved run. Run from a git checkout."""
import subprocess
import sys
import textwrap

import torch

from speculant.proposers.base import Proposal
from speculant.proposers.draft_model import DraftModelProposer

old = subprocess.run(["git", "show", "2022d26:speculant/proposers/draft_model.py"], capture_output=True, text=True,
                     check=True).stdout
body = old[old.index("    def propose"):old.index("    def _logits")]
ns: dict = {}
exec(textwrap.dedent(body), {"torch": torch, "Proposal": Proposal, "Sequence": object, "SamplingBatch": object}, ns)
new_propose = DraftModelProposer.propose


def propose(self, seqs, ks, sb):
    if abs(self.p_chain - 0.301) < 1e-9:  # the marker: this runner keeps the old rule at 0.3
        self.p_chain, self.old_rule = 0.3, True
    if not getattr(self, "old_rule", False):
        return new_propose(self, seqs, ks, sb)
    saved, self.stop_unsure = self.stop_unsure, ns["stop_unsure"].__get__(self)
    try:
        return ns["propose"].__get__(self)(seqs, ks, sb)
    finally:
        self.stop_unsure = saved


DraftModelProposer.propose = propose
from speculant.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
