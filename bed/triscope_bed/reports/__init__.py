"""Statistics, verdicts, tables and plots of the closed-loop and test-bed benches."""
