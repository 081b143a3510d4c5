"""Token accuracy of a causal LM, as an ``evaluate`` metric that loads without the Hub.

    metric = evaluate.load("examples/metrics/token_accuracy.py")   # a local script: no download
    metric.compute(predictions=[3, 5, 7], references=[3, 9, -100])  # {"accuracy": 0.5}

Same inputs and output key as the Hub's ``evaluate.load("accuracy")`` (which needs the network
and scikit-learn), so either drops into a Trainer's ``compute_metrics``. Positions whose
reference is ``ignore_index`` (-100: prompt tokens, padding) are left out.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Share of predicted token ids equal to the reference ids, ignoring positions labelled ignore_index."
_INPUTS = """
Args:
    predictions (list of int): predicted token ids (argmax of the logits, already shifted).
    references (list of int): reference token ids; ignore_index marks positions to skip.
    ignore_index (int): reference value to skip, -100 by default.
Returns:
    accuracy (float): matches / scored positions (0.0 when nothing is scored).
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _INPUTS)
class TokenAccuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, ignore_index=-100):
        preds, refs = np.asarray(predictions), np.asarray(references)
        keep = refs != ignore_index
        return {"accuracy": float((preds[keep] == refs[keep]).mean()) if keep.any() else 0.0}
