"""Knowledge-graph embedding models over EmbeddingBatch: scores against naive loops, sparse Adagrad against
torch.optim.Adagrad, filtered ranking, the done() protocol, and that training learns a planted graph."""
import warnings

import lightning as L
import pytest
import torch

from lightning_ooc.embed.batch import EmbeddingBatch
from lightning_ooc.embed.optim import sparse_adagrad_
from lightning_ooc.errors import InputError
from lightning_ooc.models import LinkPredictor
from lightning_ooc.models.kge import ComplEx, DistMult, DotKGE, KGEModel, chunked_scores
from lightning_ooc.models.ranking import positive_ranks, random_mrr, rank_metrics


def make_batch(g, num_rows=30, dim=8, b=11, chunk=4, k=5, num_relations=3, weight=None, **kw):
    """A random batch over a random ``[num_rows, dim]`` table: ``b`` edges in chunks of ``chunk``, ``k`` negatives."""
    c = -(-b // chunk)
    if weight is None:
        weight = torch.randn(num_rows, dim, generator=g)
    return EmbeddingBatch(
        src=torch.randint(0, num_rows, (b,), generator=g), dst=torch.randint(0, num_rows, (b,), generator=g),
        rel=torch.randint(0, num_relations, (b,), generator=g),
        src_rows=torch.randint(0, num_rows, (b,), generator=g), dst_rows=torch.randint(0, num_rows, (b,), generator=g),
        neg_src_rows=torch.randint(0, num_rows, (c, k), generator=g),
        neg_dst_rows=torch.randint(0, num_rows, (c, k), generator=g),
        chunk_size=chunk, weight=weight, state=torch.zeros_like(weight), **kw)


def naive_score(kind, h, r, t):
    if kind == "dot":
        return float((h * t).sum())
    if kind == "distmult":
        return float((h * r * t).sum())
    n = h.numel() // 2
    hc, rc, tc = (torch.complex(x[:n].double(), x[n:].double()) for x in (h, r, t))
    return float((hc * rc * tc.conj()).sum().real)


def random_relations(model, g):
    if model.relations is not None:
        with torch.no_grad():
            model.relations.weight.copy_(torch.randn(model.relations.weight.shape, generator=g))


# -- scores ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dot", "distmult", "complex"])
@pytest.mark.parametrize("b,chunk", [(11, 4), (12, 4), (3, 8), (1, 1)])
def test_scores_equal_a_per_edge_loop(kind, b, chunk):
    g = torch.Generator().manual_seed(b * 10 + chunk)
    model = KGEModel(num_relations=3, dim=8, score=kind)
    random_relations(model, g)
    batch = make_batch(g, b=b, chunk=chunk)
    pos, neg_dst, neg_src = model.scores(batch)
    assert pos.shape == (b,) and neg_dst.shape == neg_src.shape == (b, 5)
    w = batch.weight
    r = model.relations.weight.detach() if model.relations is not None else torch.zeros(3, 8)
    for i in range(b):
        c = i // chunk
        h, t, ri = w[batch.src_rows[i]], w[batch.dst_rows[i]], r[batch.rel[i]]
        assert pos[i].item() == pytest.approx(naive_score(kind, h, ri, t), abs=1e-4)
        for j in range(5):
            want_dst = naive_score(kind, h, ri, w[batch.neg_dst_rows[c, j]])
            want_src = naive_score(kind, w[batch.neg_src_rows[c, j]], ri, t)
            assert neg_dst[i, j].item() == pytest.approx(want_dst, abs=1e-4)
            assert neg_src[i, j].item() == pytest.approx(want_src, abs=1e-4)


def test_complex_equals_the_complex_number_formula():
    g = torch.Generator().manual_seed(3)
    model = ComplEx(num_relations=2, dim=12)
    random_relations(model, g)
    batch = make_batch(g, dim=12, num_relations=2, b=9, chunk=3, k=4)
    pos, neg_dst, neg_src = model.scores(batch)

    def cplx(x):
        return torch.complex(x[..., :6].double(), x[..., 6:].double())

    w, r = cplx(batch.weight), cplx(model.relations.weight.detach())
    h, t, rr = w[batch.src_rows], w[batch.dst_rows], r[batch.rel]
    chunk_of = batch.chunk_of_edge()
    want_pos = (h * rr * t.conj()).sum(-1).real
    want_dst = torch.einsum("bd,bkd->bk", h * rr, w[batch.neg_dst_rows[chunk_of]].conj()).real
    want_src = torch.einsum("bkd,bd->bk", w[batch.neg_src_rows[chunk_of]] * rr[:, None], t.conj()).real
    torch.testing.assert_close(pos.double(), want_pos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(neg_dst.double(), want_dst, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(neg_src.double(), want_src, rtol=1e-5, atol=1e-5)
    # relations start at 1 + 0i: ComplEx starts as the dot product (as DistMult does with ones)
    for fresh in (ComplEx(num_relations=2, dim=12), DistMult(num_relations=2, dim=12)):
        for a, d in zip(fresh.scores(batch), DotKGE(dim=12).scores(batch)):
            torch.testing.assert_close(a, d)


def test_chunked_scores_checks_and_extra_chunks():
    q, n = torch.randn(5, 3), torch.randn(4, 2, 3)  # more chunks than needed: the spare ones are unused
    torch.testing.assert_close(chunked_scores(q, n, 2), torch.stack([n[i // 2] @ q[i] for i in range(5)]))
    with pytest.raises(ValueError, match="chunks"):
        chunked_scores(torch.randn(9, 3), n, 2)
    assert chunked_scores(torch.randn(0, 3), n, 2).shape == (0, 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="score"):
        KGEModel(score="transe")
    with pytest.raises(ValueError, match="loss"):
        KGEModel(loss="bce")
    with pytest.raises(ValueError, match="even"):
        ComplEx(dim=7)
    assert DotKGE(num_relations=5).relations is None and DotKGE().configure_optimizers() is None
    assert "score" not in DistMult().hparams and KGEModel(score="dot").hparams.score == "dot"
    # the saved hyperparameters rebuild the model (as load_from_checkpoint does)
    for m in (DistMult(dim=4, num_relations=2), ComplEx(dim=4), DotKGE(dim=4), KGEModel(score="complex", dim=4)):
        again = type(m)(**m.hparams)
        assert again.score_name == m.score_name and again.hparams == m.hparams


@pytest.mark.parametrize("loss", ["softmax", "ranking"])
def test_losses_equal_a_direct_computation(loss):
    g = torch.Generator().manual_seed(5)
    model = DistMult(num_relations=3, dim=8, loss=loss, margin=0.5)
    batch = make_batch(g)
    pos, nd, ns = model.scores(batch)
    if loss == "softmax":
        want = sum(-torch.log_softmax(torch.cat([pos[:, None], n], 1), 1)[:, 0] for n in (nd, ns)).mean()
    else:
        want = sum(torch.clamp(0.5 - pos[:, None] + n, min=0).mean() for n in (nd, ns))
    assert model.loss(batch).item() == pytest.approx(want.item(), rel=1e-5)


# -- sparse Adagrad --------------------------------------------------------------------------------------
def dense_adagrad_reference(weight, rows, grads, lr, eps, steps_state=None):
    p = torch.nn.Parameter(weight.clone())
    opt = torch.optim.Adagrad([p], lr=lr, eps=eps, foreach=False)
    for r, gr in zip(rows, grads):
        opt.zero_grad()
        p.grad = torch.zeros_like(p).index_add_(0, r, gr)  # the coalesced sparse gradient, made dense
        opt.step()
    return p.detach(), opt.state[p]["sum"]


@pytest.mark.parametrize("strided", [False, True])
def test_sparse_adagrad_equals_torch_adagrad(strided):
    g = torch.Generator().manual_seed(7)
    n, dim, lr, eps = 20, 6, 0.3, 1e-10
    init = torch.randn(n, dim, generator=g)
    rows = [torch.randint(0, n, (25,), generator=g) for _ in range(3)]  # 25 draws of 20 rows: repeats
    assert all(r.unique().numel() < r.numel() for r in rows)
    rows.append(torch.tensor([4, 4, 4, 4]))
    grads = [torch.randn(r.numel(), dim, generator=g) for r in rows]
    if strided:
        buf = torch.zeros(n, 2 * dim)
        weight, state = buf[:, :dim], buf[:, dim:]
        assert not weight.is_contiguous()
    else:
        weight, state = torch.zeros(n, dim), torch.zeros(n, dim)
    weight.copy_(init)
    for r, gr in zip(rows, grads):
        sparse_adagrad_(weight, state, r, gr, lr, eps)
    want_w, want_s = dense_adagrad_reference(init, rows, grads, lr, eps)
    assert torch.equal(weight, want_w), (weight - want_w).abs().max()
    assert torch.equal(state, want_s)
    if strided:  # the views wrote into their tensor
        assert torch.equal(buf, torch.cat([want_w, want_s], 1))


def test_sparse_adagrad_leaves_other_rows_and_takes_nd_rows():
    g = torch.Generator().manual_seed(8)
    weight, state = torch.randn(10, 3, generator=g), torch.rand(10, 3, generator=g)
    w0, s0 = weight.clone(), state.clone()
    rows = torch.tensor([[1, 2], [2, 7]])
    sparse_adagrad_(weight, state, rows, torch.randn(2, 2, 3, generator=g), lr=0.1)
    changed = (weight != w0).any(1) | (state != s0).any(1)
    assert changed.nonzero().flatten().tolist() == [1, 2, 7]
    sparse_adagrad_(weight, state, torch.empty(0, dtype=torch.long), torch.empty(0, 3), lr=0.1)  # no rows: no-op
    with pytest.raises(ValueError):
        sparse_adagrad_(weight, state, torch.tensor([1, 2]), torch.randn(3, 3), lr=0.1)


# -- evaluation -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("hits_ties", ["pessimistic", "average"])
def test_ranks_and_metrics_equal_a_direct_computation(hits_ties):
    g = torch.Generator().manual_seed(9)
    model = DistMult(num_relations=3, dim=8, eval_hits=(1, 3), hits_ties=hits_ties)
    random_relations(model, g)
    batches = [make_batch(g, b=7), make_batch(g, b=5, chunk=2)]
    all_ranks, all_hit_ranks = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer
        for i, batch in enumerate(batches):
            pos, nd, ns = model.scores(batch)
            all_ranks.append(torch.cat([positive_ranks(pos, nd), positive_ranks(pos, ns)]))
            all_hit_ranks.append(torch.cat([positive_ranks(pos, nd, hits_ties), positive_ranks(pos, ns, hits_ties)]))
            model.validation_step(batch, i)
            assert batch.is_done
    ranks, hit_ranks = torch.cat(all_ranks), torch.cat(all_hit_ranks)
    got = {k: v.compute().item() for k, v in model.val_ranking.items()}
    assert got["mrr"] == pytest.approx((1 / ranks).mean().item())
    assert got["hits@1"] == pytest.approx((hit_ranks <= 1).float().mean().item())
    assert got["hits@3"] == pytest.approx((hit_ranks <= 3).float().mean().item())


def _evaluate(model, batch):
    """The validation metrics of one batch, as the model logs them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer
        model.validation_step(batch, 0)
    assert batch.is_done
    return {k: v.compute().item() for k, v in model.val_ranking.items()}


@pytest.mark.parametrize("model_cls", [DotKGE, DistMult, ComplEx])
def test_float64_scores_a_hair_apart_rank_apart(model_cls):
    """Ranking cast the scores to float32, where 1 + 1e-9 and 1 are the same number: a positive 1e-9 above
    every negative tied with all of them (MRR 0.5 and Hits@1 0 with 2 negatives); compared in float64, the
    scores' own dtype, it ranks first, as the link predictor ranks it."""
    weight = torch.tensor([[1.0, 0.0],          # 0: the head (1 + 0i for ComplEx)
                           [1.0 + 1e-9, 0.0],   # 1: its true tail: score 1 + 1e-9
                           [1.0, 0.0],          # 2: a tail negative: score 1
                           [1.0 - 1e-9, 0.0]],  # 3: a head negative: score 1 - 1e-18, 1.0 in float64
                          dtype=torch.float64)  # fmt: skip
    batch = EmbeddingBatch(src=torch.tensor([0]), dst=torch.tensor([1]), rel=torch.tensor([0]),
                           src_rows=torch.tensor([0]), dst_rows=torch.tensor([1]),
                           neg_src_rows=torch.tensor([[3, 3]]), neg_dst_rows=torch.tensor([[2, 2]]),
                           chunk_size=1, weight=weight, state=torch.zeros_like(weight))  # fmt: skip
    model = model_cls(num_relations=1, dim=2, eval_hits=(1,))
    pos, neg_dst, neg_src = model.scores(batch)
    assert pos.dtype == torch.float64 and bool((pos > neg_dst).all()) and bool((pos > neg_src).all())
    assert model.ranks(batch).tolist() == [1.0, 1.0]
    assert _evaluate(model, batch) == {"mrr": 1.0, "hits@1": 1.0}


def _tied_batch():
    """One edge (score 2) whose tail ties two of its three negatives (scores 2, 2, 0); its head beats all three."""
    weight = torch.tensor([[1.0, 0.0], [2.0, 0.0], [2.0, 0.0], [2.0, 0.0], [0.0, 0.0], [-1.0, 0.0]])
    return EmbeddingBatch(src=torch.tensor([0]), dst=torch.tensor([1]), rel=torch.tensor([0]),
                          src_rows=torch.tensor([0]), dst_rows=torch.tensor([1]),
                          neg_src_rows=torch.tensor([[5, 5, 5]]), neg_dst_rows=torch.tensor([[2, 3, 4]]),
                          chunk_size=1, weight=weight, state=torch.zeros_like(weight))  # fmt: skip


def test_hits_at_k_counts_a_tie_as_a_miss_by_default_and_half_with_average():
    """Hits@K counted a tie half, whatever the protocol; it now follows ``hits_ties`` as the link predictor does:
    by default a positive tied with its K-th best negative is a miss (ogbl-collab's ``pos > kth_neg``), with
    ``"average"`` a tie counts half (ogbl-citation2's). The MRR counts a tie half either way."""
    model = DotKGE(dim=2, eval_hits=(1, 2, 3))
    # the tail: 2 ties, none above: rank 2 with ties half, 3 with every tie above; the head: rank 1
    assert _evaluate(model, _tied_batch()) == {"mrr": 0.75, "hits@1": 0.5, "hits@2": 0.5, "hits@3": 1.0}
    assert model.hits_ties == "pessimistic" and model.hparams.hits_ties == "pessimistic"
    batch = _tied_batch()
    assert model.ranks(batch).tolist() == [2.0, 1.0]
    assert model.ranks(batch, ties="pessimistic").tolist() == [3.0, 1.0]
    average = DotKGE(dim=2, eval_hits=(1, 2, 3), hits_ties="average")
    assert _evaluate(average, _tied_batch()) == {"mrr": 0.75, "hits@1": 0.5, "hits@2": 1.0, "hits@3": 1.0}


def test_kge_and_link_predictor_rank_alike():
    """The KGE models and the link predictor count the same scores the same way, under either tie rule."""
    batch = _tied_batch()
    for ties in ("pessimistic", "average"):
        kge = DistMult(num_relations=1, dim=2, eval_hits=(1, 2, 3), hits_ties=ties)
        link = LinkPredictor(in_channels=2, hits_at=(1, 2, 3), hits_ties=ties)
        assert kge.hits_ties == link.hits_ties == ties
        parts = [rank_metrics(pos, neg, link.hits_at, link.hits_ties) for pos, neg in kge.ranked_scores(batch)]
        want = {k: torch.cat([p[k] for p in parts]).mean().item() for k in parts[0]}
        assert _evaluate(kge, _tied_batch()) == pytest.approx(want)


def test_hits_ties_is_checked_and_kept_by_every_kge_model():
    for cls in (DotKGE, DistMult, ComplEx, KGEModel):
        with pytest.raises(InputError, match="unknown hits_ties 'half'; use 'pessimistic' or 'average'"):
            cls(dim=2, hits_ties="half")
        m = cls(dim=2, hits_ties="average")
        assert m.hits_ties == "average" and type(m)(**m.hparams).hits_ties == "average"


def test_a_filtered_negative_does_not_worsen_the_rank():
    g = torch.Generator().manual_seed(10)
    model = DotKGE(dim=4)
    weight = torch.randn(12, 4, generator=g)
    weight[0] = torch.tensor([1.0, 0, 0, 0])  # head of edge 0
    weight[1] = torch.tensor([1.0, 0, 0, 0])  # its true tail: score 1
    weight[2] = torch.tensor([5.0, 0, 0, 0])  # another true tail, among the negatives: score 5
    weight[3] = torch.tensor([-1.0, 0, 0, 0])  # a real negative: score -1
    batch = EmbeddingBatch(src=torch.tensor([0]), dst=torch.tensor([1]), rel=torch.tensor([0]),
                           src_rows=torch.tensor([0]), dst_rows=torch.tensor([1]),
                           neg_src_rows=torch.tensor([[3, 3]]), neg_dst_rows=torch.tensor([[2, 3]]),
                           chunk_size=1, weight=weight, state=torch.zeros_like(weight))
    raw = model.ranks(batch)
    assert raw.tolist() == [2.0, 1.0]  # tail: 5 > 1 ranks it second; head: both negatives below
    batch.dst_filter = torch.tensor([[0], [0]])  # (edge 0, negative 0) is a known edge
    assert model.ranks(batch).tolist() == [1.0, 1.0]
    batch.src_filter = torch.tensor([[0, 0], [0, 1]])  # filtering lower-scored negatives changes nothing
    assert model.ranks(batch).tolist() == [1.0, 1.0]
    assert (model.ranks(batch) <= raw).all()


# -- training under a Trainer --------------------------------------------------------------------------
class Batches:
    """Fresh EmbeddingBatches over one table every epoch (like a partition-buffer pass), recording done()."""

    def __init__(self, edges, weight, state, k, chunk, seed, split="train", batch_size=32, num_relations=1):
        self.edges, self.weight, self.state = edges, weight, state
        self.k, self.chunk, self.seed, self.split, self.batch_size = k, chunk, seed, split, batch_size
        self.num_relations = num_relations
        self.done_log: list[tuple[int, int]] = []
        self.epoch = 0

    def __len__(self):
        return -(-self.edges.shape[1] // self.batch_size)

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + (self.epoch if self.split == "train" else 0))
        epoch, self.epoch = self.epoch, self.epoch + 1
        n = self.weight.shape[0]
        order = torch.randperm(self.edges.shape[1], generator=g) if self.split == "train" else None
        edges = self.edges if order is None else self.edges[:, order]
        for i, start in enumerate(range(0, edges.shape[1], self.batch_size)):
            src, dst = edges[:, start:start + self.batch_size]
            c = -(-src.numel() // self.chunk)
            yield EmbeddingBatch(
                src=src, dst=dst, rel=src % self.num_relations, src_rows=src, dst_rows=dst,
                neg_src_rows=torch.randint(0, n, (c, self.k), generator=g),
                neg_dst_rows=torch.randint(0, n, (c, self.k), generator=g),
                chunk_size=self.chunk, weight=self.weight, state=self.state, split=self.split, epoch=epoch, index=i,
                on_done=self._on_done)

    def _on_done(self, batch):
        # the step's updates are in place before done(): every row the batch trained has Adagrad state
        if batch.split == "train":
            assert (self.state[batch.src_rows].abs().sum(1) > 0).all()
        self.done_log.append((batch.epoch, batch.index))


def planted_graph(num_groups=8, group=8, seed=0):
    """Directed edges between every two distinct nodes of a group, split 80/20 into train and held out."""
    nodes = torch.arange(num_groups * group)
    same = (nodes[:, None] // group == nodes[None, :] // group) & (nodes[:, None] != nodes[None, :])
    edges = same.nonzero().t()
    perm = torch.randperm(edges.shape[1], generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * edges.shape[1])
    return edges[:, perm[:cut]], edges[:, perm[cut:]], num_groups * group


def trainer(epochs):
    return L.Trainer(accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


@pytest.mark.parametrize("model_cls,loss", [(DistMult, "softmax"), (ComplEx, "softmax"), (DotKGE, "ranking")])
def test_training_learns_a_planted_graph(model_cls, loss):
    L.seed_everything(0, verbose=False)
    train, held_out, n = planted_graph()
    dim, k = 16, 20
    weight, state = 0.1 * torch.randn(n, dim, generator=torch.Generator().manual_seed(1)), torch.zeros(n, dim)
    model = model_cls(num_relations=2, dim=dim, lr=0.1, loss=loss, margin=1.0)
    train_batches = Batches(train, weight, state, k=8, chunk=8, seed=2, num_relations=2)
    test_batches = Batches(held_out, weight, state, k=k, chunk=16, seed=3, split="test", num_relations=2)
    t = trainer(epochs=1)
    before = t.test(model, dataloaders=test_batches, verbose=False)[0]["test_mrr"]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*returned `None`.*")  # DotKGE has no optimizer
        t = trainer(epochs=15)
        t.fit(model, train_dataloaders=train_batches)
    after = t.test(model, dataloaders=test_batches, verbose=False)[0]
    assert before < 1.5 * random_mrr(k)
    assert after["test_mrr"] > 2 * random_mrr(k), (before, after)
    assert after["test_hits@10"] > 0.8
    # every batch was done exactly once, after its update
    assert sorted(train_batches.done_log) == [(e, i) for e in range(15) for i in range(len(train_batches))]
    assert len(test_batches.done_log) == 2 * len(test_batches)
    assert t.global_step == 15 * len(train_batches)  # one (possibly placeholder) optimizer step per batch


def test_relations_train_and_the_batch_is_moved_by_lightning():
    L.seed_everything(0, verbose=False)
    train, _, n = planted_graph(num_groups=2, group=6)
    weight, state = 0.1 * torch.randn(n, 8), torch.zeros(n, 8)
    model = DistMult(num_relations=2, dim=8, lr=0.05, relation_lr=0.2)
    seen = []
    step = model.training_step

    def spy(batch, batch_idx):
        seen.append(batch)
        return step(batch, batch_idx)

    model.training_step = spy
    batches = Batches(train, weight, state, k=4, chunk=4, seed=0, batch_size=16, num_relations=2)
    r0 = model.relations.weight.detach().clone()
    trainer(epochs=1).fit(model, train_dataloaders=batches)
    assert not torch.equal(model.relations.weight.detach(), r0)
    # Lightning moved each batch with EmbeddingBatch.to: a new object sharing the buffer's tensors,
    # whose done() reached the original batch's on_done
    assert all(b.weight is weight and b.state is state and b.on_done is not batches._on_done for b in seen)
    assert len(batches.done_log) == len(batches)


@pytest.mark.parametrize("kind", ["distmult", "complex", "dot"])
def test_a_training_step_equals_dense_autograd_and_adagrad(kind):
    """One step under a Trainer equals the loss computed edge by edge on a dense table, differentiated by
    autograd and stepped by torch.optim.Adagrad (rows repeat across edges and negatives)."""
    g = torch.Generator().manual_seed(11)
    batch = make_batch(g, num_rows=9, dim=6, b=10, chunk=4, k=3, num_relations=2)  # 9 rows: many repeats
    model = KGEModel(num_relations=2, dim=6, score=kind, lr=0.2, relation_lr=0.3)
    random_relations(model, g)
    table = torch.nn.Parameter(batch.weight.clone())
    rel = torch.nn.Parameter(model.relations.weight.detach().clone() if model.relations is not None
                             else torch.zeros(2, 6))
    n = 3

    def score(h, r, t):
        if kind == "dot":
            return (h * t).sum()
        if kind == "distmult":
            return (h * r * t).sum()
        a, b, c, d, e, f = h[:n], h[n:], r[:n], r[n:], t[:n], t[n:]
        return ((a * c - b * d) * e + (a * d + b * c) * f).sum()

    loss = 0
    for i in range(len(batch)):
        c = i // batch.chunk_size
        h, t, r = table[batch.src_rows[i]], table[batch.dst_rows[i]], rel[batch.rel[i]]
        p = score(h, r, t)
        tails = torch.stack([p] + [score(h, r, table[x]) for x in batch.neg_dst_rows[c]])
        heads = torch.stack([p] + [score(table[x], r, t) for x in batch.neg_src_rows[c]])
        loss = loss - torch.log_softmax(tails, 0)[0] - torch.log_softmax(heads, 0)[0]
    (loss / len(batch)).backward()
    torch.optim.Adagrad([table], lr=0.2, eps=1e-10, foreach=False).step()
    torch.optim.Adagrad([rel], lr=0.3, eps=1e-10, foreach=False).step()

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*returned `None`.*")
        trainer(epochs=1).fit(model, train_dataloaders=torch.utils.data.DataLoader([batch], batch_size=None))
    assert batch.is_done
    torch.testing.assert_close(batch.weight, table.detach(), rtol=1e-5, atol=1e-6)
    if model.relations is not None:
        torch.testing.assert_close(model.relations.weight.detach(), rel.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw, name", [({"lr": -1}, "lr"), ({"lr": float("nan")}, "lr"), ({"dim": 0}, "dim"),
                                      ({"num_relations": 0}, "num_relations"), ({"eval_hits": [0]}, "eval_hits"),
                                      ({"margin": -0.1}, "margin"), ({"score": "bogus"}, "score"),
                                      ({"relation_lr": 0}, "relation_lr")])  # fmt: skip
def test_bad_arguments_are_input_errors_naming_them(kw, name):
    from lightning_ooc.errors import InputError
    from lightning_ooc.models.kge import KGEModel

    with pytest.raises(InputError, match=name):
        KGEModel(**kw)
