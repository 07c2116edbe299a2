"""The contract machinery itself: the schema check, rendering and comparison rules fail where they should."""

from __future__ import annotations

import contractlib
import pytest

GOOD = {
    "role": "nvidia_driver",
    "variable": "nvidia_driver_dkms_module",
    "distribution": "ubuntu-22.04",
    "kind": "dkms-module",
    "value": "nvidia-srv",
    "checked": "fixture",
    "source": "ubuntu:pool/x.deb sha256:0",
    "probe": {
        "archive": "ubuntu",
        "suite": "jammy-updates",
        "component": "restricted",
        "package": "nvidia-dkms-580-server",
        "read": "dkms",
    },
}


def _fact(**changes: object) -> contractlib.Fact:
    return contractlib.Fact("t", 0, {**GOOD, **changes})


def test_schema_accepts_a_complete_entry() -> None:
    assert contractlib.validate_entry(GOOD, "t") == []


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"checked": "downloaded"}, "Ubuntu facts are checked 'fixture'"),
        ({"checked": "documented"}, "a documented fact has no probe"),
        ({"checked": "maybe"}, "checked must be one of"),
        ({"probe": {**GOOD["probe"], "suite": "noble"}}, "is not one of ubuntu-22.04's"),
        ({"probe": {**GOOD["probe"], "read": "guess"}}, "probe read must be one of"),
        ({"probe": None}, "needs a probe"),
    ],
)
def test_schema_names_what_is_wrong(changes: dict[str, object], problem: str) -> None:
    entry = {**GOOD, **changes}
    if entry["probe"] is None:
        del entry["probe"]
    assert any(problem in p for p in contractlib.validate_entry(entry, "t"))


def test_missing_key_is_named() -> None:
    entry = {k: v for k, v in GOOD.items() if k != "source"}
    assert "t: missing key 'source'" in contractlib.validate_entry(entry, "t")


def test_role_variable_the_role_lacks_fails_by_name() -> None:
    rv = contractlib.RoleVars("nvidia_driver", contractlib.DISTRIBUTIONS["ubuntu-22.04"])
    with pytest.raises(contractlib.ContractError, match="defines no nvidia_driver_nonsense"):
        rv.get("nvidia_driver_nonsense")


def test_role_side_detects_drift() -> None:
    proprietary = {"nvidia_driver_kernel_modules": "proprietary"}
    assert contractlib.role_says(_fact(vars=proprietary))[0]
    # Unset, 580 gets the open modules, whose DKMS name is "nvidia": the proprietary name no longer holds.
    assert not contractlib.role_says(_fact())[0]
    assert contractlib.role_says(_fact(value="nvidia"))[0]
    overridden = _fact(
        variable="nvidia_driver_persistenced_command", value="--no-persistence-mode", role_must_not_use=True
    )
    assert contractlib.role_says(overridden)[0]


def _reading(value: object) -> contractlib.Reading:
    return contractlib.Reading(value, "ubuntu", "p", "1-1", "pool/p_1-1.deb", "0")


def test_comparison_rules() -> None:
    versions = _fact(value="580.178.04", probe={**GOOD["probe"], "read": "versions"})
    assert contractlib.matches(versions, _reading(["580.178.04-0ubuntu0.22.04.1"]))
    assert not contractlib.matches(versions, _reading(["580.159.03-0ubuntu0.22.04.1"]))
    flag = _fact(value="--verbose", probe={**GOOD["probe"], "read": "exec-start"})
    assert contractlib.matches(flag, _reading("/usr/bin/x --user u --verbose"))
    assert not contractlib.matches(flag, _reading("/usr/bin/x --verbose-ish"))
    transitional = _fact(value="nvidia-dkms-535-server", probe={**GOOD["probe"], "read": "package"})
    assert not contractlib.matches(transitional, _reading("nvidia-dkms-535-server (transitional to 580)"))


def test_table_needs_its_markers() -> None:
    with pytest.raises(contractlib.ContractError, match="lacks the markers"):
        contractlib.doc_with_table("# no markers\n", "| t |")
    doc = f"a\n{contractlib.TABLE_BEGIN}\nold\n{contractlib.TABLE_END}\nb\n"
    assert (
        contractlib.doc_with_table(doc, "new")
        == f"a\n{contractlib.TABLE_BEGIN}\nnew\n{contractlib.TABLE_END}\nb\n"
    )
