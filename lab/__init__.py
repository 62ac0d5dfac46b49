"""What only measures the project, never what a user's command runs: calibration of the memory model, the
benchmark printers and probes, the device scripts (``lab/device/``). Tested with the suite, not in the wheel."""
