"""The base model's license: from its card (local folder, Hub cache, the Hub), or plainly unknown."""


import pytest

from fasttune.export import base_license
from fasttune.export.base_license import UNKNOWN_TEXT, BaseLicense, find_base_license, from_card_data


@pytest.mark.parametrize("data, expected", [
    ({"license": "apache-2.0"}, BaseLicense("apache-2.0", source="s")),
    ({"license": ["mit"]}, BaseLicense("mit", source="s")),
    ({"license": "other", "license_name": "qwen", "license_link": "https://x/LICENSE"},
     BaseLicense("other", "qwen", "https://x/LICENSE", "s")),
    ({"license": ["mit", "apache-2.0"]}, None), ({"license": " "}, None), ({}, None), (None, None), ("x", None)])
def test_license_from_card_data(data, expected):
    assert from_card_data(data, "s") == expected


def test_what_the_card_prints_and_its_front_matter():
    assert BaseLicense().text == UNKNOWN_TEXT == "unknown — check the base model's license"
    assert BaseLicense().front_matter() == {}
    lic = BaseLicense("other", "qwen", "https://x/LICENSE", "from the card of org/m")
    assert lic.text == "qwen (from the card of org/m)"
    assert lic.front_matter() == {"license": "other", "license_name": "qwen", "license_link": "https://x/LICENSE"}


def test_local_card_then_cached_card_then_unknown_offline(tmp_path, monkeypatch):
    (tmp_path / "README.md").write_text("---\nlicense: gemma\n---\n# a local base\n")
    assert find_base_license(None, tmp_path) == BaseLicense("gemma", source="from the base model's card")
    (tmp_path / "README.md").write_text("# no front matter\n")
    assert find_base_license(None, tmp_path) == BaseLicense()
    cached = tmp_path / "cached.md"
    cached.write_text("---\nlicense: llama3.1\n---\n")
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: str(cached))
    assert find_base_license("meta-llama/x", tmp_path).license == "llama3.1"
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: None)
    asked = []
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: asked.append(1))
    assert find_base_license("meta-llama/x") == BaseLicense()  # HF_HUB_OFFLINE=1 here: the Hub is not asked
    assert asked == [] and base_license.find_base_license(None) == BaseLicense()
