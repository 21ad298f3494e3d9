"""maspo-verl: granular importance-ratio policy losses for verl.

Three layers, each importing only the ones below it (docs/contributing.md, "Layout"):

- core (``core``: the loss pipeline, token sets -> ratios -> clipping -> surrogates -> losses, the segment
  rules, the ratio correlation metrics and the plain reference loss; beside it ``advantages``, ``batch``,
  ``batch_sizes``, ``config``, ``config_fields``, ``fsq``, ``inspection``, ``rollout_correction``, ``util``,
  ``validation``, ``vocab``): the maths and the config checks; importing it registers and patches nothing;
- plugin (``maspo_verl.plugin``): the ``verl.plugins`` entry point that ``import verl`` loads in the
  driver and in every Ray worker; it registers the losses and the estimator (``plugin``), installs the
  hooks (``plugin.hooks``) and holds the start-up checks (``plugin.checks``);
- recipes and tools (``main``, ``local``, ``speech``, ``math``, ``lab``).

Importing this package itself loads nothing.
"""

__version__ = "0.1.0"
