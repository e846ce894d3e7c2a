"""``calclip compare``: does FP8 + Calibrated Clipping train like BF16 on this setup?

- `arms`: named override sets (presets and ``--arm NAME:field=value,...``) over one shared config.
- `runner`: one ``calclip train`` process per arm x seed in its own folder; parallel, resumable, time-limited.
- `folder`: the comparison folder and its config fingerprint.
- `report`: the Markdown table (window means +- std over seeds) and the figure.
- `command`: the command line (``calclip.cli.compare`` calls `command.main`).

The runs write what ``calclip.run.run_outputs`` defines (the metrics file, the exit status of a stopped run),
through the callbacks of ``calclip.run.run_callbacks``: any `calclip train` run can, compare only reads them.
"""
