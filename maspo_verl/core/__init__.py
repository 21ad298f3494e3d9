"""The loss core: from token log-ratios to the loss (docs/contributing.md, "Layout")."""
