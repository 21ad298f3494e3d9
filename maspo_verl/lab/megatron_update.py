"""``python -m maspo_verl.lab.megatron_update``, the name committed results' COMMAND.txt runs: the study is
:mod:`maspo_verl.lab.studies.megatron_update`."""

from maspo_verl.lab.studies.megatron_update import main

if __name__ == "__main__":
    raise SystemExit(main())
