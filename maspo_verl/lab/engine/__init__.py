"""The lab's engine: what every study stands on (presets and arms, cells, the tabular policy, tuning, statistics,
the journal, tables and plots, study discovery). It imports no study."""
