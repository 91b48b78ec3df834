"""Dataset store: checksummed shards, a map-style reader, node-local cache.

Millions of small records (molecular structures with energies and forces, or any small
files) become a few large shards with a columnar index and a manifest of xxh3 checksums;
``open_dataset`` reads any record by index (shards mapped lazily, every frame's CRC
checked), and a node-local cache tier keeps the parallel file system out of the inner
loop. The trainer reads through it (:class:`convergent.train.moldata.MoleculeSource`:
random access in its step plan, each record once); the streaming reader the data-read
benchmark measures over these shards is bench/dataio/stream.py.

Modules (each with one job):

* :mod:`~convergent.data.format`    shard layout: header, checksummed frames, trailer
* :mod:`~convergent.data.records`   record encoding (molecular, bytes) and their index columns
* :mod:`~convergent.data.index`     the columnar index (named arrays behind a JSON table)
* :mod:`~convergent.data.manifest`  ``manifest.json``: the commit point of a dataset
* :mod:`~convergent.data.reader`    ``open_dataset`` (map-style), ``split_by_molecule``
* :mod:`~convergent.data.indexscan` ``IndexScan``: one checked index column in pieces
* :mod:`~convergent.data.writer`    ``DatasetWriter`` (single process), ``write_subset``
* :mod:`~convergent.data.parallel`  ``write_parallel`` on Dask, index merge
* :mod:`~convergent.data.cache`     ``ShardCache``, ``Prefetcher`` (node-local tier)
* :mod:`~convergent.data.pack`      ``pack_directory`` (``convergent data pack``)
* :mod:`~convergent.data.verify`, :mod:`~convergent.data.inspect`,
  :mod:`~convergent.data.export`    the ``data verify|inspect|export`` tools
* :mod:`~convergent.data.mds`       MDS (mosaicml-streaming) writer for ``export --to mds``

Molecular record (dict): ``key`` str (unique), ``molecule_id`` str, ``numbers``
int64[N], ``positions`` float64[N, 3] (Å), ``energy`` float (eV), ``forces``
float64[N, 3] (eV/Å; NaN when written as None), ``cell`` float64[3, 3] (zeros if none),
``pbc`` bool[3], ``charge`` int, ``multiplicity`` int, ``meta`` dict (JSON).
Bytes record: ``key`` str, ``payload`` bytes.
"""
