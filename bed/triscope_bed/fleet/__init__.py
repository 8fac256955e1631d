"""The benches: the closed loop, the test bed and the calibration, and the fleets and feeds they run."""
