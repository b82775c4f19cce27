"""Turning byte budgets into tier sizes, and the plan printed once at setup."""
from __future__ import annotations

from dataclasses import dataclass

from lightning_ooc.errors import InputError
from lightning_ooc.data.format import human_bytes, parse_bytes
from lightning_ooc.store.buffer import required_slots


@dataclass
class StorePlan:
    """Sizes of every tier for one process, derived from the budgets."""

    row_bytes: int
    num_nodes: int
    buffer_slots: int
    buffer_reserve: int
    max_nodes_per_batch: int
    host_rows: int
    staging_bytes: int
    staging_chunk_rows: int
    device: str
    expected_host_hit: float | None = None
    expected_buffer_hit: float | None = None
    host_policy: str = "presample"
    presample_batches: int = 0
    backend: str = ""
    backend_reason: str = ""

    @classmethod
    def from_budgets(
        cls,
        *,
        num_nodes: int,
        row_bytes: int,
        gpu_cache: int | str,
        host_cache: int | str,
        staging: int | str,
        max_nodes_per_batch: int,
        num_extractors: int,
        train_queue_size: int,
        device: str,
        order: str = "out_of_order",
        staging_chunk_rows: int = 8192,
    ) -> "StorePlan":
        gpu_b, host_b, stage_b = parse_bytes(gpu_cache), parse_bytes(host_cache), parse_bytes(staging)
        # a node holds at most one slot, so no more than num_nodes slots are ever needed at once
        reserve = min(required_slots(max_nodes_per_batch, num_extractors, train_queue_size, order), num_nodes)
        slots = min(gpu_b // row_bytes, num_nodes)
        if slots < reserve:
            need = reserve * row_bytes
            held = (f"{num_extractors} extractors" if order == "out_of_order"
                    else f"{num_extractors} extractors + train queue {train_queue_size} + 2, in order")  # fmt: skip
            raise InputError(
                f"gpu_cache={human_bytes(gpu_b)} holds {slots:,} rows of {row_bytes} B but the pipeline needs at "
                f"least {reserve:,} ({held}, batches of up to {max_nodes_per_batch:,} nodes) so that extraction "
                f"cannot deadlock; set gpu_cache to at least {human_bytes(need)}, or lower batch_size, "
                "num_neighbors or num_extractors"
            )
        if stage_b < row_bytes:
            raise InputError(f"staging={human_bytes(stage_b)} cannot hold one row of {row_bytes} B; give it at least 1MiB")
        host_rows = min(host_b // row_bytes, num_nodes)
        stage_b = min(stage_b, max(num_nodes * row_bytes, row_bytes * max(2, num_extractors)))
        chunk_rows = max(1, min(staging_chunk_rows, stage_b // row_bytes // max(2, num_extractors)))
        return cls(
            row_bytes=row_bytes, num_nodes=num_nodes, buffer_slots=int(slots), buffer_reserve=int(reserve),
            max_nodes_per_batch=int(max_nodes_per_batch), host_rows=int(host_rows), staging_bytes=int(stage_b),
            staging_chunk_rows=int(chunk_rows), device=device,
        )  # fmt: skip

    def format(self, *, extra: list[str] | None = None) -> str:
        rb = self.row_bytes
        host_hit = f", expected hit rate {self.expected_host_hit:.1%}" if self.expected_host_hit is not None else ""
        buf_hit = f", expected hit rate {self.expected_buffer_hit:.1%}" if self.expected_buffer_hit is not None else ""
        chosen = (f"chosen by access frequency over {self.presample_batches} presampled batches"
                  if self.host_policy == "presample" else "chosen by in-degree")  # fmt: skip
        lines = [
            f"  feature buffer  {human_bytes(self.buffer_slots * rb):>11}  {self.buffer_slots:,} slots on {self.device} "
            f"(reserve {self.buffer_reserve:,} = batches in flight x {self.max_nodes_per_batch:,} nodes){buf_hit}",
            f"  host cache      {human_bytes(self.host_rows * rb):>11}  {self.host_rows:,} rows "
            f"({self.host_rows / max(self.num_nodes, 1):.1%} of nodes), {chosen}{host_hit}",
            f"  staging         {human_bytes(self.staging_bytes):>11}  chunks of {self.staging_chunk_rows:,} rows",
            f"  SSD             {human_bytes(self.num_nodes * rb):>11}  {self.num_nodes:,} rows of {rb} B, "
            f"reader backend {self.backend} ({self.backend_reason})",
        ]
        return "\n".join(["lightning_ooc plan:"] + lines + (extra or []))
