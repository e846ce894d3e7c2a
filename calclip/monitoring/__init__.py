"""What a run (or ``calclip diagnose``) shows about itself, on top of TRL's own metrics.

- ``callbacks``: entropy-spike detector, garbled-output signal, W&B alerts.
- ``mismatch_outliers``: the rollout-vs-trainer log-prob outliers log.
- ``ratio_distributions``: FP8 and BF16-shadow ratios split by advantage sign, and the shares bounds drop (pure
  torch); ``ratio_histograms``: their W&B histograms on calibration steps.
- ``ratio_probe`` / ``plots``: the ratio probe of a moved policy and its figure (``calclip diagnose --plot``).

Modules are imported by their full path; nothing is re-exported.
"""
