"""What a run reports besides its checkpoints: the log line of a step and of an evaluation,
TensorBoard scalars, the history a checkpoint keeps, and OUT_DIR/loss.png at the end.

    log = RunLog(cfg, history, master=rank == 0)
    log.step(step, loss, lr, seconds, throughput, mfu, bar)   # every --log-interval steps
    log.evaluation(step, metrics, saved)
    log.close()                                               # loss.png, TensorBoard closed
"""
import os

from tqdm import tqdm

from toolkit.config import RunConfig
from toolkit.files import atomic_write


class RunLog:
    """What a run reports besides checkpoints: the log line of a step and of an evaluation,
    TensorBoard scalars (`loss/train`, `lr`, `perf/*`, `eval/<metric>`), the history a checkpoint
    keeps, and OUT_DIR/loss.png at the end. Only rank 0 prints and writes; every rank keeps the
    evaluations."""

    def __init__(self, cfg: RunConfig, history: dict | None, master: bool):
        self.cfg, self.master, self.writer = cfg, master, None
        self.history = {"iter": [], "loss": [], "eval_iter": [], "val": [], "metrics": [],
                        **(history or {})}

    def step(self, step: int, loss: float, lr: float, dt: float, throughput: tuple,
             mfu: float | None, bar) -> None:
        if not self.master:
            return
        count, unit, _ = throughput
        self.history["iter"].append(step)
        self.history["loss"].append(loss)
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        bar.write(f"iter {step}: loss {loss:.4f}, lr {lr:.2e}, {dt * 1000:.1f} ms, "
                  f"{count / dt:,.0f} {unit}/s" + (f", mfu {mfu * 100:.1f}%" if mfu else ""))
        scalars = {"loss/train": loss, "lr": lr, f"perf/{unit}_per_s": count / dt, "perf/mfu": mfu}
        for tag, value in scalars.items():
            if value is not None:
                self.tensorboard().add_scalar(tag, value, step)

    def evaluation(self, step: int, metrics: dict[str, float], saved: str | None) -> None:
        self.history["eval_iter"].append(step)
        self.history["val"].append(metrics.get("val_loss"))
        self.history["metrics"].append(metrics)
        if not self.master:
            return
        shown = ", ".join(f"{name.replace('_', ' ')} {value:.4f}"
                          for name, value in metrics.items())
        tqdm.write(f"step {step}: {shown}" + (f"; saved {saved}" if saved else ""))
        for name, value in metrics.items():
            self.tensorboard().add_scalar(f"eval/{name}", value, step)

    def tensorboard(self):
        """A SummaryWriter for this run: TENSORBOARD_DIR (default OUT_DIR/tensorboard)
        / RUN_NAME."""
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter  # 220 ms: when first logged
            folder = self.cfg.tensorboard_dir or os.path.join(self.cfg.out_dir, "tensorboard")
            self.writer = SummaryWriter(os.path.join(folder, self.cfg.run_name))
        return self.writer

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        """The loss curve, and the TensorBoard file closed."""
        if self.master:
            plot_losses(self.history, self.cfg.out_dir)
            if self.writer is not None:
                self.writer.close()


def plot_losses(history: dict, out_dir: str) -> None:
    """OUT_DIR/loss.png: the train loss at each logged step and the val loss at each evaluation."""
    import matplotlib  # 430 ms with pyplot: once, at the end
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(history["iter"], history["loss"], label="train loss", linewidth=1)
    evaluated = [(i, v) for i, v in zip(history["eval_iter"], history["val"]) if v is not None]
    if evaluated:
        ax.plot(*zip(*evaluated), "o-", label="val loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(os.path.join(out_dir, "loss.png"),
                 lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
