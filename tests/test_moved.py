"""The old import paths of moved modules (``ddp_rank/_moved.py``): the same module object, one
DeprecationWarning naming the new path and pointing at the importing line, and no warning on the new paths."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_rank import _moved

PACKAGE = Path(_moved.__file__).resolve().parent


def _run(code: str) -> dict:
    """Run ``code`` in a fresh interpreter (a warning is given once per process) and return its JSON output."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    return json.loads(out.splitlines()[-1])


_PROBE = """
import importlib, json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import ddp_rank.data.manifest as old
    import ddp_rank.data.manifest as again
    importlib.import_module("ddp_rank.train.layout")
    from ddp_rank.data.recipes import sop
    import ddp_rank.data.format.manifest as new
    import ddp_rank.data.building.recipes.sop as new_sop
mine = [w for w in caught if issubclass(w.category, DeprecationWarning) and "moved to" in str(w.message)]
print(json.dumps({
    "same": old is new and again is new and sop is new_sop,
    "name": old.__name__,
    "messages": [str(w.message) for w in mine],
    "files": [w.filename for w in mine],
}))
"""


def test_an_old_path_gives_the_moved_module_and_warns_once() -> None:
    got = _run(_PROBE)
    assert got["same"]
    assert got["name"] == "ddp_rank.data.format.manifest"
    # one warning per old name: the manifest (imported twice) and the recipes package; the module inside the
    # moved package comes through the package's new folder, without a warning of its own
    assert got["messages"][0] == (
        "ddp_rank.data.manifest moved to ddp_rank.data.format.manifest; the old import path goes in the next release"
    )
    assert len([m for m in got["messages"] if m.startswith("ddp_rank.data.manifest ")]) == 1
    assert any(m.startswith("ddp_rank.data.recipes moved to") for m in got["messages"])
    assert set(got["files"]) == {"<string>"}, "the warning points at the importing line, not at importlib"


def test_new_paths_and_package_exports_do_not_warn() -> None:
    code = (
        "import json, warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "import ddp_rank.data.format.manifest, ddp_rank.train.chunking.layout, ddp_rank.checkpoints.file_checks\n"
        "from ddp_rank.data import Manifest, ShardStore, build_shards\n"
        "print(json.dumps({'ok': Manifest.__module__}))\n"
    )
    assert _run(code) == {"ok": "ddp_rank.data.format.manifest"}


def test_a_patch_through_an_old_path_reaches_the_code() -> None:
    """``mock.patch("ddp_rank.train.chunk_choice.X")`` in code written before the move still patches what runs."""
    code = (
        "import json, warnings\n"
        "warnings.simplefilter('ignore')\n"
        "from unittest import mock\n"
        "import ddp_rank.train.chunking.choice as choice\n"
        "with mock.patch('ddp_rank.train.chunk_choice.CHUNK_PROBE_MARK', 'patched', create=True):\n"
        "    seen = choice.CHUNK_PROBE_MARK\n"
        "print(json.dumps({'seen': seen}))\n"
    )
    assert _run(code) == {"seen": "patched"}


def test_every_entry_names_a_real_new_module_and_no_old_file_is_left() -> None:
    """A stale entry (a module moved again, or renamed) fails here; so does a stub file at an old path, which
    would shadow the finder's module with a second copy and hide the rename from git."""
    for old, new in _moved.MOVED.items():
        assert importlib.util.find_spec(new) is not None, f"{old} -> {new}: no such module"
        rel = Path(*old.split(".")[1:])
        assert not (PACKAGE / rel.with_suffix(".py")).exists() and not (PACKAGE / rel).is_dir(), (
            f"{old} is still a file: remove it, the finder serves the old name"
        )


def test_names_outside_the_map_are_not_touched() -> None:
    assert _moved.new_name("ddp_rank.data") is None
    assert _moved.new_name("ddp_rank.data.manifesto") is None
    assert _moved.new_name("ddp_rank.data.recipes.sop") == "ddp_rank.data.building.recipes.sop"
    assert _moved.MovedFinder().find_spec("ddp_rank.losses.fastap") is None


_NAMES_PROBE = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from ddp_rank.runtime.accelerator import make_accelerator
    from ddp_rank.runtime.data_setup import data_seed
    from ddp_rank.eval.runner import deployment_settings
    import ddp_rank.runtime.settings as runtime_settings, ddp_rank.eval.settings as eval_settings
    same = [
        make_accelerator is runtime_settings.make_accelerator,
        data_seed is runtime_settings.data_seed,
        deployment_settings is eval_settings.deployment_settings,
    ]
import ddp_rank.eval.feature_images as old_images
try:
    old_images.image_config
    gone = ""
except AttributeError as exc:
    gone = str(exc)
mine = [w for w in caught if issubclass(w.category, DeprecationWarning) and "moved to" in str(w.message)]
print(json.dumps({"same": same, "messages": [str(w.message) for w in mine], "files": [w.filename for w in mine],
                  "gone": gone}))
"""


@pytest.fixture(scope="module")
def names_probe() -> dict:
    """``_NAMES_PROBE``'s answer, one fresh interpreter for the two tests that read it."""
    return _run(_NAMES_PROBE)


def test_public_names_that_moved_out_of_a_module_keep_their_old_import_with_a_warning(
    names_probe: dict,
) -> None:
    got = names_probe
    assert got["same"] == [True, True, True]
    assert got["messages"] == [
        "ddp_rank.runtime.accelerator.make_accelerator moved to ddp_rank.runtime.settings.make_accelerator; the old "
        "import path goes in the next release",
        "ddp_rank.runtime.data_setup.data_seed moved to ddp_rank.runtime.settings.data_seed; the old import path "
        "goes in the next release",
        "ddp_rank.eval.runner.deployment_settings moved to ddp_rank.eval.settings.deployment_settings; the old "
        "import path goes in the next release",
    ]
    assert set(got["files"]) == {"<string>"}, "the warning points at the importing line"


def test_a_removed_name_of_another_signature_names_its_replacement(names_probe: dict) -> None:
    """``image_config(cfg)`` became ``image_data(data, record)``: no shim could keep the call, so the old name
    fails at once, saying what to call instead (through the old module path too; ``from ... import`` gets
    Python's own "cannot import name", which replaces a module ``__getattr__``'s AttributeError)."""
    import ddp_rank.features.images as images

    with pytest.raises(AttributeError, match=r"image_config was removed: use image_data\(data_settings, "):
        images.image_config  # noqa: B018
    assert "image_data(data_settings" in names_probe["gone"]
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        images.nothing_here  # noqa: B018
