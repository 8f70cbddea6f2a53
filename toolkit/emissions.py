"""Energy and CO2 of a run with codecarbon's offline tracker (Megatron-DeepSpeed's recipe records
them): --codecarbon-dir DIR appends one row per run to DIR/emissions.csv. codecarbon is optional: it
is imported only when asked for (toolkit/megatron.py checks that it is installed).

    with tracking_emissions(cfg, master=rank == 0):
        trainer.fit()
"""
import os
from contextlib import contextmanager


@contextmanager
def tracking_emissions(cfg, master: bool):
    """codecarbon's OfflineEmissionsTracker around the block when the run sets --codecarbon-dir
    (rank 0); its row is appended to CODECARBON_DIR/emissions.csv however the block ends."""
    if not (master and cfg.codecarbon_dir):
        yield
        return
    from codecarbon import OfflineEmissionsTracker  # optional, 110 ms
    os.makedirs(cfg.codecarbon_dir, exist_ok=True)
    tracker = OfflineEmissionsTracker(country_iso_code=cfg.codecarbon_country,
                                      output_dir=cfg.codecarbon_dir, project_name=cfg.run_name,
                                      log_level="error", allow_multiple_runs=True)
    tracker.start()
    try:
        yield
    finally:
        tracker.stop()
