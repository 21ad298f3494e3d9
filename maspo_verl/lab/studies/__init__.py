"""The lab's studies, one module each; a module with a ``STUDY`` declaration (``engine.study.Study``) is found by
the CLI, docs/lab.md's table and the regeneration test."""
