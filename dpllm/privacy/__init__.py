"""The DP engine: Opacus wrapping, clipping functions, accounting and planning."""
