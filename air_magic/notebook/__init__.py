"""The IPython surface: ``%%distributed`` / ``%distributed`` and the cell analysis behind them."""
