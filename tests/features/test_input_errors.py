"""Input errors say what to set: the data.columns.* key, the nearest column, a log without time; and
they come from the file headers before TensorFlow loads."""

import subprocess
import sys
from pathlib import Path

import pytest

from retrieval.config import ColumnsConfig, TableConfig, load_config
from retrieval.data import DataError, read_clicks
from retrieval.features.inputs import check_inputs
from retrieval.features.tables import missing_feature_column

ROOT = Path(__file__).resolve().parents[2]


def _csv(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_missing_click_column_names_the_key_to_set_and_the_nearest_column(tmp_path):
    path = _csv(tmp_path, "clicks.csv", "user,item_id,time\nu1,i1,5\n")
    with pytest.raises(DataError) as caught:
        read_clicks(TableConfig(path=path), ColumnsConfig(user="usr"))
    message = str(caught.value)
    assert "missing columns 'usr', 'timestamp'" in message
    assert "'usr': set data.columns.user to the column that holds it (did you mean 'user'?)" in message
    assert ("'timestamp': set data.columns.timestamp to the column that holds it (did you mean 'time'?); "
            "a log without time sets data.columns.timestamp: null") in message
    no_time = _csv(tmp_path, "no_time.csv", "user_id,item_id\nu1,i1\n")
    with pytest.raises(DataError, match=r"missing column 'timestamp'.*data\.columns\.timestamp: null"):
        read_clicks(TableConfig(path=no_time), ColumnsConfig())
    assert len(read_clicks(TableConfig(path=no_time), ColumnsConfig(timestamp=None))) == 1  # as the error says


def test_a_misspelt_feature_column_gets_did_you_mean():
    message = missing_feature_column("colour", "colour", "doc", ["item_id", "color", "price"])
    assert "feature 'colour' reads column 'colour', which is in neither" in message
    assert message.endswith("did you mean 'color'? (the feature's name (or source) names the column)")
    assert "did you mean" not in missing_feature_column("zzz", "zzz", "doc", ["item_id", "color"])


def _feature_config(tmp_path, item_id_column="item_id", feature="colour"):
    clicks = _csv(tmp_path, "clicks.csv", "user_id,item_id,timestamp\nu1,i1,5\nu2,i2,6\n")
    items = _csv(tmp_path, "items.csv", "item_id,color\ni1,red\ni2,blue\n")
    return load_config(None, [
        f"data.clicks.path={clicks}", f"data.item_features.path={items}", f"data.item_id_column={item_id_column}",
        f"towers.doc.features=[{{name: item_id, kind: id}}, {{name: {feature}, kind: categorical}}]",
    ])


def test_headers_are_checked_against_the_config_without_reading_the_log(tmp_path):
    check_inputs(_feature_config(tmp_path, feature="color"))  # all there: nothing raised
    with pytest.raises(DataError, match=r"towers\.doc: feature 'colour' reads column 'colour'.*did you mean 'color'"):
        check_inputs(_feature_config(tmp_path))
    with pytest.raises(DataError, match=r"items\.csv: missing column 'itemid'.*set data\.item_id_column .*'item_id'"):
        check_inputs(_feature_config(tmp_path, item_id_column="itemid", feature="color"))
    missing = load_config(None, [f"data.clicks.path={tmp_path / 'nope.csv'}"])
    with pytest.raises(DataError, match="nope.csv"):
        check_inputs(missing)


def test_train_stops_on_a_missing_column_before_tensorflow_loads(tmp_path):
    path = _csv(tmp_path, "clicks.csv", "user_id,item_id,time\nu1,i1,5\n")
    script = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('tensorflow loaded:', 'tensorflow' in sys.modules))\n"
        "from retrieval.cli import main\n"
        f"sys.exit(main(['train', '--set', 'data.clicks.path={path}', '--set', 'run.output_dir={tmp_path}']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "set data.columns.timestamp to the column that holds it (did you mean 'time'?)" in done.stderr
    assert done.stdout.strip().endswith("tensorflow loaded: False")
