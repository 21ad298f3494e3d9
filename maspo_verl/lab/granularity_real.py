"""``python -m maspo_verl.lab.granularity_real``, the command part 5's registration names: the study is
:mod:`maspo_verl.lab.studies.granularity_real`."""

from maspo_verl.lab.studies.granularity_real import main

if __name__ == "__main__":
    raise SystemExit(main())
