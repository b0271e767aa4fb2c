"""Loading from a Hugging Face cache: only the shards the requested layers need, offline, with byte estimates.

The caches are built by hand in the layout huggingface_hub writes (`models--org--name/refs/main`,
`blobs/<sha>`, `snapshots/<commit>/<file>` -> ../../blobs/<sha>), holding a sharded tiny checkpoint
whose unrequested shards are ABSENT. No test touches the network: every load runs offline.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REFERENCE_DIR

from kimi_explore import CheckpointError, KimiDecodeState, from_pretrained, hub, kimi_forward_token
from kimi_explore.weights.safetensors_io import SafetensorsFile, write_safetensors
from kimi_explore.weights.tiny_model import make_text_config, write_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "org/tiny-k3"
TOKENS = [3, 141, 59, 26, 5, 35]


def build_cache(cache: Path, repo_id: str, src: Path, files: list[str]) -> Path:
    """Put `files` of checkpoint dir `src` into a hand-built HF cache; returns the snapshot directory."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(COMMIT)
    snap = root / "snapshots" / COMMIT
    for f in files:
        data = (src / f).read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / f
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snap


def weight_map(src: Path) -> dict[str, str]:
    return json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]


def shards_of_layers(src: Path, layers) -> list[str]:
    """Shard names holding the given layers or global tensors, read from the index."""
    out = set()
    for name, shard in weight_map(src).items():
        parts = name.split(".")
        if "layers" not in parts or int(parts[parts.index("layers") + 1]) in layers:
            out.add(shard)
    return sorted(out)


def decode(w, tokens=TOKENS):
    state = KimiDecodeState.new(w)
    return np.stack([np.array(kimi_forward_token(w, state, t)) for t in tokens])


def truncated_text_config(n: int) -> dict:
    """The embedded model's config cut to its first n layers (layer lists cut to 1..n)."""
    cfg = make_text_config()
    la = dict(cfg["linear_attn_config"])
    la["kda_layers"] = [x for x in la["kda_layers"] if x <= n]
    la["full_attn_layers"] = [x for x in la["full_attn_layers"] if x <= n]
    return make_text_config(num_hidden_layers=n, linear_attn_config=la)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The embedded-model weights (seed 0 here) in 9 shards: one global shard, then 2 layers per shard."""
    src = write_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", seed=0, shards=9)
    (src / "tokenizer_config.json").write_text('{"note": "a tokenizer file the hub loader should fetch"}\n')
    return src


@pytest.fixture
def cache(tmp_path, sharded):
    """A cache holding config, index, the tokenizer file and only the shards of layers 0..3."""
    needed = shards_of_layers(sharded, range(4))
    assert len(needed) == 3  # global + layers 0-1 + layers 2-3; the other 6 shards are absent
    small_files = ["config.json", "model.safetensors.index.json", "tokenizer_config.json"]
    build_cache(tmp_path / "hub", REPO, sharded, small_files + needed)
    return tmp_path / "hub"


def load(repo, cache_dir, **kw):
    return from_pretrained(repo, device="cpu", cache_dir=cache_dir, local_files_only=True,
                                              progress=False, **kw)


def test_offline_layer_subset_equals_the_model_cut_to_those_layers(cache, tmp_path):
    w = load(REPO, cache, layers=range(0, 4))
    assert w.layer_ids == [0, 1, 2, 3]
    # the same seed written as a 4-layer model: the generator draws globals, then layers in order
    small = write_checkpoint(tmp_path / "four", truncated_text_config(4), seed=0)
    expected = decode(from_pretrained(small, device="cpu"))
    got = decode(w)
    np.testing.assert_array_equal(got, expected)


def test_layers_as_an_iterator_are_taken_once(cache):
    """The Hub plan consumed a generator, then the check saw layers=[] ("selects no layer") after the download."""
    np.testing.assert_array_equal(decode(load(REPO, cache, layers=(i for i in range(4)))),
                                  decode(load(REPO, cache, layers=range(0, 4))))


def test_env_offline_and_hf_home(cache, tmp_path):
    """HF_HUB_OFFLINE=1 and HF_HOME set in the environment (read by huggingface_hub at import), in a fresh process."""
    home = tmp_path / "hf_home"
    home.mkdir()
    shutil.copytree(cache, home / "hub", symlinks=True)
    code = (
        "import numpy as np, sys\n"
        "from kimi_explore import KimiDecodeState, from_pretrained, kimi_forward_token\n"
        f"w = from_pretrained({REPO!r}, layers=range(0, 4), device='cpu')\n"
        "s = KimiDecodeState.new(w)\n"
        f"np.save(sys.argv[1], np.stack([kimi_forward_token(w, s, t) for t in {TOKENS!r}]))\n"
    )
    env = clean_env(HF_HUB_OFFLINE="1", HF_HOME=str(home))
    out = tmp_path / "logits.npy"
    r = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).parent)
    assert r.returncode == 0, r.stderr
    assert "layers 0-3 need 3 of 9 weight shard(s)" in r.stderr  # the up-front line
    np.testing.assert_array_equal(np.load(out), decode(load(REPO, cache, layers=range(0, 4))))


def test_missing_shards_are_listed_with_the_layers_that_need_them(cache, sharded):
    with pytest.raises(CheckpointError) as e:
        load(REPO, cache, layers=range(0, 8))
    msg = str(e.value)
    absent = [s for s in shards_of_layers(sharded, range(4, 8)) if s not in shards_of_layers(sharded, range(4))]
    assert len(absent) == 2
    assert f"{absent[0]} (needed by layers [4, 5])" in msg
    assert f"{absent[1]} (needed by layers [6, 7])" in msg
    assert "2 shard file(s)" in msg and f"not in the Hugging Face cache at {cache}, and local_files_only=True" in msg
    for present in shards_of_layers(sharded, range(4)):
        assert present not in msg


def test_nothing_cached_names_the_repo_the_cache_and_why(tmp_path, monkeypatch):
    with pytest.raises(CheckpointError) as e:
        load("org/absent", tmp_path, layers=[0])
    assert str(e.value).startswith(f"org/absent: config.json is not in the Hugging Face cache at {tmp_path} and "
                                   "local_files_only=True")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read at call time
    with pytest.raises(CheckpointError) as e:
        from_pretrained("org/absent", device="cpu", cache_dir=tmp_path, progress=False)
    assert f"cache at {tmp_path} and HF_HUB_OFFLINE is set" in str(e.value) and "local_files_only" not in str(e.value)


def clean_env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    return {**env, **kw}


def test_an_unreachable_hub_is_asked_once_then_the_cache_is_used(cache, tmp_path):
    """A closed loopback port as the endpoint: the load goes to the cache at once and says why (huggingface_hub
    alone retries every file with backoff); a repo that is not cached fails with the path and the reason."""
    home = tmp_path / "hf_home"
    home.mkdir()
    shutil.copytree(cache, home / "hub", symlinks=True)
    env = clean_env(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(home))
    code = ("from kimi_explore import from_pretrained\n"
            f"w = from_pretrained({REPO!r}, layers=range(0, 4), device='cpu')\n"
            "print(w.layer_ids)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[0, 1, 2, 3]"
    assert "cache only: the Hub at http://127.0.0.1:9 is not reachable" in r.stderr and "Retry" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "kimi_explore", "--checkpoint", "org/absent"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Retry" not in r.stderr
    assert r.stderr.splitlines() == [
        f"kimi-explore: error: org/absent: config.json is not in the Hugging Face cache at {home / 'hub'} and the Hub "
        "at http://127.0.0.1:9 is not reachable (ConnectError: [Errno 111] Connection refused); nor is 'org/absent' "
        "a local directory"]


def test_the_cli_offline_message_names_the_cache_not_local_files_only(tmp_path):
    env = clean_env(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "kimi_explore", "--checkpoint", "org/absent"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert f"not in the Hugging Face cache at {tmp_path / 'hub'} and HF_HUB_OFFLINE is set" in r.stderr
    assert "local_files_only" not in r.stderr


def test_byte_estimate_offline_counts_the_cached_files(cache, sharded):
    plan = hub.plan_download(REPO, layers=range(0, 4), cache_dir=cache, local_files_only=True)
    files, nbytes = plan
    shards = shards_of_layers(sharded, range(4))
    assert files == ["config.json", "model.safetensors.index.json", "tokenizer_config.json"] + shards
    assert nbytes == sum((sharded / f).stat().st_size for f in files)
    assert plan.shards == shards and plan.total_shards == 9
    assert plan.needed_by == {shards[0]: [-1], shards[1]: [0, 1], shards[2]: [2, 3]}
    assert plan.to_fetch == [] and plan.bytes_to_fetch == 0
    assert "layers 0-3 need 3 of 9 weight shard(s)" in plan.describe() and "nothing to download" in plan.describe()


def test_byte_estimate_online_uses_hub_sizes(cache, sharded, monkeypatch):
    """Online, sizes come from the Hub (`get_paths_info`; faked here) and cached files are not fetched again."""
    asked = []

    def fake_sizes(repo_id, files, *, revision, token):
        asked.extend(files)
        return {f: 1000 + i for i, f in enumerate(files) if (sharded / f).exists()}, True

    monkeypatch.setattr(hub, "_remote_sizes", fake_sizes)
    monkeypatch.setattr(hub, "_offline", lambda local_files_only: "")
    real = hub._download
    monkeypatch.setattr(hub, "_download", lambda *a, **kw: real(*a, **{**kw, "offline": True}))
    plan = hub.plan_download(REPO, layers=[4, 5, 6], cache_dir=cache)
    shards = shards_of_layers(sharded, [4, 5, 6])
    assert plan.shards == shards and len(shards) == 3  # global + layers 4-5 + layers 6-7
    fake = {f: 1000 + i for i, f in enumerate(asked) if (sharded / f).exists()}
    assert plan.bytes == sum(fake[f] for f in plan.files)
    assert plan.to_fetch == shards[1:]  # the global shard is cached, the two layer shards are not
    assert plan.bytes_to_fetch == fake[shards[1]] + fake[shards[2]]
    assert "tokenizer_config.json" in plan.files and "tiktoken.model" not in plan.files


def test_shard_names_come_from_the_index(tmp_path, sharded):
    """Unconventional shard names: the loader must read them from weight_map, never construct them."""
    src = tmp_path / "renamed"
    shutil.copytree(sharded, src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    rename = {old: f"weights-part-{chr(97 + i)}.safetensors" for i, old in enumerate(sorted(set(index["weight_map"].values())))}
    for old, new in rename.items():
        (src / old).rename(src / new)
    index["weight_map"] = {k: rename[v] for k, v in index["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    needed = shards_of_layers(src, [2, 3])
    build_cache(tmp_path / "hub", REPO, src, ["config.json", "model.safetensors.index.json"] + needed)
    w = load(REPO, tmp_path / "hub", layers=[2, 3])
    np.testing.assert_array_equal(decode(w), decode(from_pretrained(sharded, device="cpu", layers=[2, 3])))
    assert hub.plan_download(REPO, layers=[2, 3], cache_dir=tmp_path / "hub", local_files_only=True).shards == needed


def test_reference_checkpoint_resharded_matches_moonshots_truncated_logits(tmp_path, ref):
    """Moonshot's tiny reference, split one shard per layer in a cache holding only layers 0-3: its 4-layer logits."""
    f = SafetensorsFile(REFERENCE_DIR / "model.safetensors")
    groups: dict[str, dict] = {}
    for name in f.keys():
        parts = name.split(".")
        key = f"layer-{int(parts[parts.index('layers') + 1]):02d}" if "layers" in parts else "global"
        groups.setdefault(f"{key}.safetensors", {})[name] = np.array(f.array(name))
    f.close()
    src = tmp_path / "resharded"
    src.mkdir()
    for shard, tensors in groups.items():
        write_safetensors(src / shard, tensors)
    shutil.copy(REFERENCE_DIR / "config.json", src / "config.json")
    wm = {n: shard for shard, tensors in groups.items() for n in tensors}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    files = ["config.json", "model.safetensors.index.json", "global.safetensors"]
    files += [f"layer-{i:02d}.safetensors" for i in range(4)]
    build_cache(tmp_path / "hub", "moonshot-ref/tiny-k3", src, files)
    w = load("moonshot-ref/tiny-k3", tmp_path / "hub", layers=range(4))
    logits = decode(w, [int(t) for t in ref["tokens"]])
    np.testing.assert_allclose(logits, ref["logits_decode_trunc4"], atol=1e-3, rtol=0)
    local = from_pretrained(REFERENCE_DIR, device="cpu", layers=range(4))
    np.testing.assert_array_equal(logits, decode(local, [int(t) for t in ref["tokens"]]))


def test_single_file_repo(tmp_path):
    src = write_checkpoint(tmp_path / "single", make_text_config(num_hidden_layers=2, linear_attn_config={
        **make_text_config()["linear_attn_config"], "kda_layers": [1], "full_attn_layers": [2]}), seed=1, index=False)
    build_cache(tmp_path / "hub", "org/single", src, ["config.json", "model.safetensors"])
    plan = hub.plan_download("org/single", cache_dir=tmp_path / "hub", local_files_only=True)
    assert plan.shards == ["model.safetensors"] and plan.files == ["config.json", "model.safetensors"]
    w = load("org/single", tmp_path / "hub")
    np.testing.assert_array_equal(decode(w), decode(from_pretrained(src, device="cpu")))


def test_paths_and_repo_ids(tmp_path, sharded):
    assert hub.resolve_checkpoint(sharded) == sharded
    assert hub.is_repo_id("moonshotai/Kimi-K3") and not hub.is_repo_id("a/b/c") and not hub.is_repo_id("../x")
    with pytest.raises(CheckpointError, match="not a checkpoint directory .* and not a Hub repo id"):
        hub.resolve_checkpoint(tmp_path / "nowhere" / "deeper")
    with pytest.raises(ValueError, match="revision='v1' applies to Hub repo ids"):
        from_pretrained(sharded, device="cpu", revision="v1")


@pytest.fixture(scope="module")
def globals_split(tmp_path_factory, sharded):
    """`sharded` with its global shard split in two: the token embedding alone in one file, the output head
    (output mix, final norm, lm_head) in another; the layer shards as they are."""
    src = tmp_path_factory.mktemp("split") / "ckpt"
    shutil.copytree(sharded, src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    (embed_name,) = [n for n in wm if n.endswith("embed_tokens.weight")]
    head_names = [n for n in wm if ".layers." not in n and n != embed_name]
    assert {wm[n] for n in head_names} == {wm[embed_name]}  # one global shard, as the fixture writes it
    f = SafetensorsFile(src / wm[embed_name])
    tensors = {k: np.array(f.array(k)) for k in f.keys()}
    f.close()
    write_safetensors(src / "embedding.safetensors", {embed_name: tensors.pop(embed_name)})
    write_safetensors(src / wm[embed_name], tensors)  # what is left: the head
    wm[embed_name] = "embedding.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return src


# mutation: a Hub plan that ignored embedding=False / head=False (a pipeline stage then downloads the embedding
# or lm_head shards)
@pytest.mark.parametrize("layers,embedding,head", [((2, 3), False, False), ((0, 1), True, False), ((14, 15), False, True)],
                         ids=["middle-stage", "first-stage", "last-stage"])
def test_mutation_stage_plan_leaves_out_embedding_and_head_shards(tmp_path, globals_split, layers, embedding, head):
    """A stage's plan lists exactly the shards holding its layers' tensors, plus the embedding's shard only
    with embedding=True and the head's only with head=True; a cache holding just those loads the stage."""
    wm = weight_map(globals_split)
    want = {shard for name, shard in wm.items() if any(f".layers.{i}." in name for i in layers)}
    want |= {wm[n] for n in wm if n.endswith("embed_tokens.weight")} if embedding else set()
    want |= {wm[n] for n in wm if ".layers." not in n and not n.endswith("embed_tokens.weight")} if head else set()
    assert len(want) == 1 + embedding + head  # the split keeps each part in a shard of its own
    build_cache(tmp_path / "hub", REPO, globals_split, ["config.json", "model.safetensors.index.json", *sorted(want)])
    plan = hub.plan_download(REPO, layers=list(layers), cache_dir=tmp_path / "hub", local_files_only=True,
                             embedding=embedding, head=head)
    assert set(plan.shards) == want
    assert plan.to_fetch == [] and plan.total_shards == 10
    w = load(REPO, tmp_path / "hub", layers=list(layers), embedding=embedding, head=head)
    assert w.layer_ids == list(layers)
    assert (w.embed_tokens is not None) == embedding and (w.lm_head is not None) == head


def test_load_tokenizer_takes_a_repo_id_from_the_cache(tmp_path):
    """The README's pipeline example called load_tokenizer("moonshotai/Kimi-K3"): it refused the repo id as a missing
    directory (and a RayPipeline's source, a repo id, fell back to its config)."""
    src = Path(__file__).parent / "data" / "tokenizer" / "synthetic_k3"
    build_cache(tmp_path / "hub", "org/tok", src, ["config.json", "tiktoken.model", "tokenizer_config.json"])
    code = ("import kimi_explore as ke\n"
            "t = ke.load_tokenizer('org/tok')\n"
            "print(type(t).__name__, t.encode('hello'), t.vocab_size)\n")
    r = subprocess.run([sys.executable, "-c", code], env=clean_env(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path)),
                       capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent)
    assert r.returncode == 0, r.stderr
    from kimi_explore import load_tokenizer

    here = load_tokenizer(src)
    assert r.stdout.split()[0] == "KimiTokenizer" and r.stdout.strip().endswith(f"{here.encode('hello')} {here.vocab_size}")
