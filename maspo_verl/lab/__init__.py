"""The lab: pre-registered studies and benchmarks, ``python -m maspo_verl.lab <command>`` (``--help`` lists them).

- ``engine/``: what every study stands on, once: the arm grammar and presets (``presets``), the grid's cells
  (``cells``), the tabular policy (``tabular``) and the grid's engine on it (``grid``), tuning on tuning seeds
  (``tuning``), pairing, tests and Holm (``stats``), the journal of a results folder (``journal``: COMMAND.txt,
  versions, machine, load, its DEVIATIONS.md), tables and plots (``common``), the local trainer's runs and their
  records (``runs``), the lab's in-process RL loop (``learn_engine``), the registered granularity protocol that its
  parts share (``protocol``: design, families, tests, decisions, report sections) and its piece engine (``pieces``:
  a part as resumable ``lab learn`` pieces), the toy race's engine (``race``), the SmolLM2 policy (``smollm2``),
  and study discovery, the CLI's parser and a README's sections from several studies (``study``).
- ``studies/``: one module per study, which imports only the engine (tests/test_layers.py). A module that declares
  ``STUDY = Study(command, summary, folder=..., writes=...)`` is a command of the CLI, a row of docs/lab.md's table
  and a folder tests/lab/test_regenerate.py regenerates.

Each command writes its tables and plots to ``outputs/lab/<folder>/`` (``--out DIR`` elsewhere, ``--update-docs``
the committed ``docs/results/<folder>/``) with a ``COMMAND.txt`` recording the exact command line that made them.
"""
