"""CallCounts: what ran fused in the first optimizer step, logged once (every fasttune entry point adds it)."""

from __future__ import annotations

from transformers import TrainerCallback

from ..model_patches.report import PatchReport, log_calls


class CallCounts(TrainerCallback):
    """Logs once, after the first optimizer step, how many calls of each patched op ran fasttune's
    kernel (``PatchReport.call_summary``), and warns for each op that ran none, with the reason.

    Args:
        reports: label ("model", "reference model") → PatchReport; more may be added until training.
    """

    def __init__(self, reports: dict[str, PatchReport] | None = None):
        self.reports = dict(reports or {})
        self._logged = False

    def on_train_begin(self, args, state, control, **kwargs):
        for report in self.reports.values():
            report.calls.clear()  # the first step's calls, not what ran before training
        self._logged = False
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if not self._logged:
            self._logged = True
            if state.is_world_process_zero:
                for label, report in self.reports.items():
                    log_calls(report, label)
        return control
