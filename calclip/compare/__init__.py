"""``calclip compare``: does FP8 + Calibrated Clipping train like BF16 on this setup?

- `arms`: named override sets (presets and ``--arm NAME:field=value,...``) over one shared config.
- `runner`: one ``calclip train`` process per arm x seed in its own folder; parallel, resumable, time-limited.
- `callback`: the trainer callbacks those runs use (metrics file, checkpoint on SIGTERM).
- `metrics`: the per-run metrics file (one JSON line per logged step).
- `folder`: the comparison folder and its config fingerprint.
- `report`: the Markdown table (window means +- std over seeds) and the figure.
- `command`: the command line (``calclip.cli`` calls `command.main`).
"""
