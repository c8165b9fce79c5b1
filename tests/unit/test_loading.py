"""load_model's refusals, in the user's words."""

import pytest

from pqcache import ModelNotFoundError, load_model


def test_load_model_missing_folder_says_what_to_do(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist.*local transformers model folder"):
        load_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_model(str(tmp_path / "empty"))
