"""maspo-verl: granular importance-ratio policy losses for verl.

Three layers, each importing only the ones below it (docs/contributing.md, "Layout"):

- core (``core``, ``advantages``, ``batch``, ``batch_sizes``, ``clipping``, ``config``, ``config_fields``, ``fsq``,
  ``inspection``, ``losses``, ``ratios``, ``reference_loss``, ``rollout_correction``, ``segments``, ``surrogates``,
  ``token_sets``, ``util``, ``validation``, ``vocab``): the maths and the config checks; importing it registers
  and patches nothing;
- plugin (``maspo_verl.plugin``): the ``verl.plugins`` entry point that ``import verl`` loads in the
  driver and in every Ray worker; it registers the losses and the estimator (``plugin``), installs the
  hooks (``plugin.hooks``) and holds the start-up checks (``plugin.checks``);
- recipes and tools (``main``, ``local``, ``speech``, ``math``, ``lab``).

Importing this package itself loads nothing.
"""

__version__ = "0.1.0"
