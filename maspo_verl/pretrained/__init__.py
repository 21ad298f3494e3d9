"""Real pretrained models prepared into the cache (no download), and tasks they can partly do.

Imports nothing of the package: the local mode, the lab and the recipes use it alike."""
