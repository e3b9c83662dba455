//! `format::model`: a safetensors model, one file or many shards, resolved
//! from a path and loaded shard by shard through [`LoadRequest`].
//!
//! A model path is a `.safetensors` file (itself), an index (`*.json`:
//! its `weight_map` of tensor name to shard file names the shards,
//! relative to the index), or a directory: its [`INDEX_NAME`], else its
//! only `*.safetensors.index.json`, else all its `*.safetensors` files in
//! name order. A directory with several other index files (a diffusers
//! model's variants) is an error naming them.
//!
//! The index is untrusted input, as a header is. [`Model::resolve`]
//! refuses, naming the index, the tensor and the value: an index that is
//! not a regular file or exceeds [`MAX_INDEX_LEN`] bytes, JSON that does
//! not parse or gives a key twice in one object, a missing or empty
//! `weight_map`, a shard name that is no file name (empty, `.`, `..`, a
//! NUL), one outside the index's directory (absolute or with `..`), one
//! that does not exist. Shards may be symlinks (the Hugging Face cache
//! links into `../../blobs`): the rule is about the names in the index.
//! [`Model::open`] then opens each shard once and reads its header once,
//! and checks the headers against each other and the map before any data
//! is read: a tensor in two shards, a tensor the map puts in a shard that
//! lacks it, a tensor the map does not list.
//!
//! An object URL (`s3://BUCKET/...`, docs/object-storage.md) is resolved
//! the same way over an object store: a prefix ending in `/` is its
//! [`INDEX_NAME`], else its [`SINGLE_NAME`] (a prefix is not listed); a
//! `*.json` key is an index, checked as an index file is, whose shards are
//! keys beside it, each looked up (a HEAD); any other key is one shard.
//! [`Model::load`] loads such a model through [`ObjectModel`]: each shard
//! once into host memory, its header parsed from those bytes, or onto a
//! device (`cuda:N`), its header read first with a ranged GET.
//!
//! The messages quote names as Python's `repr` does, so that Python's
//! `dmaload.safetensors` (which raises these) reads as it always has.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use super::safetensors::{read_header_of, Error, Header, MAX_HEADER_LEN};
use crate::cancel::CancelToken;
use crate::error::Error as IoError;
use crate::load::{LoadRequest, Loaded};
use crate::object::Object;
use crate::options::LoadOptions;
use crate::report::LoadReport;
use crate::source::OpenFile;

/// The index a directory's model is read from when it has one.
pub const INDEX_NAME: &str = "model.safetensors.index.json";

/// The one file of a model without an index (a prefix's, in object storage).
pub const SINGLE_NAME: &str = "model.safetensors";

/// The largest index read (bytes): an index is untrusted, as a header is.
pub const MAX_INDEX_LEN: u64 = MAX_HEADER_LEN;

/// A model's files, resolved from a path; nothing is loaded yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Model {
    /// The shard files (or object URLs, `s3://BUCKET/KEY`), in name order
    /// for a directory without an index, else in the order of their first
    /// mention in the index.
    pub shards: Vec<PathBuf>,
    /// The index's `weight_map` in the index's order, each shard name
    /// normalized (`./a.safetensors` is `a.safetensors`, one shard): `None`
    /// without an index.
    pub weight_map: Option<Vec<(String, String)>>,
}

impl Model {
    /// The model at `path` (see the module's documentation): the index, if
    /// any, read and checked; the shards found but not opened.
    pub fn resolve(path: &Path) -> Result<Model, Error> {
        if crate::object::is_object_url(path) {
            return Model::resolve_object(&path.to_string_lossy(), &CancelToken::new());
        }
        if path.is_dir() {
            let mut indexes = Vec::new();
            let mut files = Vec::new();
            let entries = std::fs::read_dir(path).map_err(|e| IoError::io("read directory", path, e))?;
            for entry in entries {
                let entry = entry.map_err(|e| IoError::io("read directory", path, e))?;
                let name = entry.file_name();
                let name = name.to_string_lossy();
                // is_file follows links: a link to a directory (or to
                // itself) named like an index is not an index.
                if !entry.path().is_file() {
                    continue;
                }
                if name.ends_with(".safetensors.index.json") {
                    indexes.push(entry.path());
                } else if name.ends_with(".safetensors") {
                    files.push(entry.path());
                }
            }
            indexes.sort();
            files.sort();
            let main = path.join(INDEX_NAME);
            if main.is_file() {
                return Model::from_index(&main);
            }
            match indexes.len() {
                1 => return Model::from_index(&indexes[0]),
                0 => {}
                n => {
                    let names: Vec<String> = indexes
                        .iter()
                        .map(|f| f.file_name().unwrap_or_default().to_string_lossy().into())
                        .collect();
                    return Err(Error::Model(format!(
                        "{}: {n} index files ({}) and no {INDEX_NAME}: pass the index to load",
                        path.display(),
                        names.join(", ")
                    )));
                }
            }
            if files.is_empty() {
                return Err(IoError::with_errno(
                    "load model",
                    path,
                    libc::ENOENT,
                    "no *.safetensors files in directory",
                )
                .into());
            }
            return Ok(Model { shards: files, weight_map: None });
        }
        if path.extension().is_some_and(|e| e == "json") {
            return Model::from_index(path);
        }
        Ok(Model { shards: vec![path.to_owned()], weight_map: None })
    }

    /// The shards the index at `index` names, checked before anything is
    /// loaded (the module's documentation lists the checks).
    pub fn from_index(index: &Path) -> Result<Model, Error> {
        let text = read_index(index)?;
        let dir = index.parent().unwrap_or(Path::new(""));
        Model::from_index_text(&text, index, |key| {
            let shard = dir.join(key);
            let exists = shard.exists();
            Ok((shard, exists))
        })
    }

    /// The checks of an index's text, shared by files and objects:
    /// `locate` gives each normalized shard name's path or URL, and whether
    /// it exists.
    fn from_index_text(
        text: &[u8],
        index: &Path,
        mut locate: impl FnMut(&str) -> Result<(PathBuf, bool), Error>,
    ) -> Result<Model, Error> {
        let fail = |message: String| Error::Model(format!("{}: {message}", index.display()));
        let parsed: IndexJson =
            serde_json::from_slice(text).map_err(|e| fail(format!("invalid index JSON: {e}")))?;
        let weight_map = parsed
            .weight_map
            .ok_or_else(|| fail("index has no weight_map of tensor name -> file name".into()))?;
        if weight_map.is_empty() {
            return Err(fail("index has an empty weight_map: it names no tensor and no shard".into()));
        }
        let mut shards = Vec::new();
        let mut seen = HashMap::new();
        let mut normalized = Vec::with_capacity(weight_map.len());
        for (tensor, name) in weight_map {
            let key = shard_key(&name).map_err(|why| {
                fail(format!("tensor {} is mapped to {}{why}", py_repr(&tensor), py_repr(&name)))
            })?;
            if !seen.contains_key(&key) {
                let (shard, exists) = locate(&key)?;
                if !exists {
                    let message = format!(
                        "{}: tensor {} is mapped to shard {}, which does not exist",
                        index.display(),
                        py_repr(&tensor),
                        py_repr(&name)
                    );
                    return Err(IoError::with_errno("load model", &shard, libc::ENOENT, message).into());
                }
                seen.insert(key.clone(), shards.len());
                shards.push(shard);
            }
            normalized.push((tensor, key));
        }
        Ok(Model { shards, weight_map: Some(normalized) })
    }

    /// The model at an object URL: a prefix (`s3://B/model/`) is its
    /// [`INDEX_NAME`], else its `model.safetensors` (a prefix is not
    /// listed); a `*.json` key is an index whose shards are keys beside
    /// it; any other key is one shard. The index object is read whole (at
    /// most [`MAX_INDEX_LEN`] bytes) and checked as a file's index is;
    /// each shard it names is looked up (a HEAD).
    fn resolve_object(url: &str, cancel: &CancelToken) -> Result<Model, Error> {
        if url.ends_with('/') {
            let index = format!("{url}{INDEX_NAME}");
            if let Some(model) = object_if_exists(&index, cancel, |o| Model::from_index_object(o, cancel))? {
                return Ok(model);
            }
            let single = format!("{url}{SINGLE_NAME}");
            if object_if_exists(&single, cancel, |_| Ok(()))?.is_some() {
                return Ok(Model { shards: vec![PathBuf::from(single)], weight_map: None });
            }
            return Err(IoError::with_errno(
                "load model",
                Path::new(url),
                libc::ENOENT,
                format!("no {INDEX_NAME} and no {SINGLE_NAME} under this prefix"),
            )
            .into());
        }
        if url.ends_with(".json") {
            let object = Object::open(url, cancel)?;
            return Model::from_index_object(&object, cancel);
        }
        Ok(Model { shards: vec![PathBuf::from(url)], weight_map: None })
    }

    /// [`Model::from_index`] of an index object: its shards are keys
    /// relative to the index's key, each looked up (a HEAD).
    fn from_index_object(index: &Object, cancel: &CancelToken) -> Result<Model, Error> {
        if index.size > MAX_INDEX_LEN {
            return Err(Error::Model(format!(
                "{}: the index exceeds the limit of {MAX_INDEX_LEN} bytes",
                index.name().display()
            )));
        }
        let options = LoadOptions { cancel: cancel.clone(), ..LoadOptions::default() };
        let (text, _) = LoadRequest::object(index).options(&options).to_buffer()?;
        let dir = match index.key().rfind('/') {
            Some(slash) => &index.key()[..=slash],
            None => "",
        };
        Model::from_index_text(&text, index.name(), |key| {
            let shard = format!("s3://{}/{dir}{key}", index.bucket());
            let exists = object_if_exists(&shard, cancel, |_| Ok(()))?.is_some();
            Ok((PathBuf::from(shard), exists))
        })
    }

    /// Loads every shard whole (see [`OpenModel::load`]): files are opened
    /// and their headers checked against each other and the index first;
    /// objects are looked up first (a HEAD each), then each loaded once
    /// into host memory, its header parsed from the loaded bytes with the
    /// checks of a file's, and the headers checked as a file model's
    /// before anything is returned.
    pub fn load(&self, options: &LoadOptions) -> Result<Vec<LoadedShard>, Error> {
        if self.shards.first().is_some_and(|s| crate::object::is_object_url(s)) {
            return self.load_objects(options);
        }
        self.open()?.load(options)
    }

    /// Opens each shard once and reads its header once, then checks the
    /// headers against each other and the weight map, before any data is
    /// read.
    pub fn open(&self) -> Result<OpenModel, Error> {
        let mut shards = Vec::with_capacity(self.shards.len());
        for path in &self.shards {
            let file = OpenFile::open(path)?;
            let (header, json) = read_header_of(&file)?;
            shards.push(OpenShard { file, header, json });
        }
        let tables: Vec<(String, Vec<&str>)> = shards
            .iter()
            .map(|s| {
                (
                    s.file.path().display().to_string(),
                    s.header.tensors.iter().map(|t| t.name.as_str()).collect(),
                )
            })
            .collect();
        let owner = tensor_index(&tables, self.weight_map.as_deref())?;
        Ok(OpenModel { shards, owner })
    }

    fn load_objects(&self, options: &LoadOptions) -> Result<Vec<LoadedShard>, Error> {
        self.open_objects(&options.cancel)?.load(options)
    }

    /// Looks up each shard of a model in object storage (a HEAD each: its
    /// size and the ETag its load pins); nothing is read yet.
    pub fn open_objects(&self, cancel: &CancelToken) -> Result<ObjectModel, Error> {
        let objects = self
            .shards
            .iter()
            .map(|url| Object::open(&url.to_string_lossy(), cancel))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ObjectModel { objects, weight_map: self.weight_map.clone() })
    }
}

/// A model's shard objects, looked up: what [`ObjectModel::load`] reads.
pub struct ObjectModel {
    pub objects: Vec<Object>,
    weight_map: Option<Vec<(String, String)>>,
}

impl ObjectModel {
    /// The bytes of all the shards.
    pub fn len(&self) -> u64 {
        self.objects.iter().map(|o| o.size).sum()
    }

    /// Whether the model has no bytes at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Loads each shard whole into the destination `options.to` names,
    /// one after another (each load runs its own GETs in parallel), with
    /// `options.progress` counting over all of them. Into host memory each
    /// header is parsed from the loaded bytes with the checks of a file's
    /// ([`super::safetensors::parse`]); elsewhere (`cuda:N`, through the
    /// core's device path for objects) the headers are read first
    /// ([`super::safetensors::read_object_header`], pinned to the same
    /// ETag as the load). Either way the headers are checked against each
    /// other and the index as a file model's are before anything is
    /// returned: before any data is loaded where they are read first.
    pub fn load(&self, options: &LoadOptions) -> Result<Vec<LoadedShard>, Error> {
        let mut read_first = Vec::new();
        if !options.to.is_host() {
            for object in &self.objects {
                read_first.push(super::safetensors::read_object_header(object, &options.cancel)?.0);
            }
            self.check_tables(read_first.iter().zip(&self.objects).map(|(h, o)| (o.name(), h)))?;
        }
        let mut read_first = read_first.into_iter();
        let total = self.len();
        let mut loaded = Vec::with_capacity(self.objects.len());
        let mut done = 0;
        for object in &self.objects {
            let mut shard_options = options.clone();
            if let Some(progress) = options.progress.clone() {
                shard_options.progress = Some(Arc::new(move |now, _| progress(done + now, total)));
            }
            let request = LoadRequest::object(object).options(&shard_options);
            let (header, data, report) = match read_first.next() {
                Some(header) => {
                    let (data, report) = request.load()?;
                    (header, data, report)
                }
                None => {
                    let (buffer, report) = request.to_buffer()?;
                    let header = super::safetensors::parse(&buffer, buffer.len() as u64)
                        .map_err(|error| Error::Header { path: object.name().to_owned(), error })?;
                    (header, Loaded::Host(buffer), report)
                }
            };
            done += object.size;
            loaded.push(LoadedShard { path: object.name().to_owned(), header, loaded: data, report });
        }
        if options.to.is_host() {
            self.check_tables(loaded.iter().map(|s| (s.path.as_path(), &s.header)))?;
        }
        Ok(loaded)
    }

    /// The shards' tensor tables checked against each other and the index.
    fn check_tables<'h>(&self, headers: impl Iterator<Item = (&'h Path, &'h Header)>) -> Result<(), Error> {
        let tables: Vec<(String, Vec<&str>)> = headers
            .map(|(path, header)| {
                (path.display().to_string(), header.tensors.iter().map(|t| t.name.as_str()).collect())
            })
            .collect();
        tensor_index(&tables, self.weight_map.as_deref()).map(drop)
    }
}

/// A model's shards, each open with its header read: what a load reads.
pub struct OpenModel {
    pub shards: Vec<OpenShard>,
    /// Each tensor's shard (its position in `shards`).
    pub owner: BTreeMap<String, usize>,
}

/// One shard, open once: its loads read this file, and its header bytes.
pub struct OpenShard {
    pub file: OpenFile,
    pub header: Header,
    json: Vec<u8>,
}

/// One shard loaded: where its bytes went and how the load went.
#[derive(Debug)]
pub struct LoadedShard {
    pub path: PathBuf,
    pub header: Header,
    pub loaded: Loaded,
    pub report: LoadReport,
}

impl OpenModel {
    /// Loads every shard whole, one after another, each through
    /// [`LoadRequest::open`] with `options` (its destination, its
    /// `verify` against the sums file beside that shard). A host load is
    /// then checked to hold the header that was validated.
    pub fn load(&self, options: &LoadOptions) -> Result<Vec<LoadedShard>, Error> {
        let mut loaded = Vec::with_capacity(self.shards.len());
        for shard in &self.shards {
            let (data, report) = LoadRequest::open(&shard.file).options(options).load()?;
            if let Loaded::Host(buffer) = &data {
                super::safetensors::check_loaded(shard.file.path(), &shard.header, &shard.json, buffer)?;
            }
            loaded.push(LoadedShard {
                path: shard.file.path().to_owned(),
                header: shard.header.clone(),
                loaded: data,
                report,
            });
        }
        Ok(loaded)
    }
}

/// The normalized name of a shard (`os.path.normpath`'s for a relative
/// name), or why `name` is refused.
fn shard_key(name: &str) -> Result<String, &'static str> {
    let path = Path::new(name);
    // pathlib's parts: "." components dropped, the root kept.
    let parts: Vec<Component<'_>> = path.components().filter(|c| *c != Component::CurDir).collect();
    let last = match parts.last() {
        Some(Component::Normal(n)) => n.to_str().unwrap_or(""),
        Some(Component::ParentDir) => "..",
        _ => "",
    };
    if name.contains('\0') || name.is_empty() || matches!(last, "" | "." | "..") {
        return Err(", which is not a file name");
    }
    if parts.iter().any(|c| !matches!(c, Component::Normal(_))) {
        return Err(", which is outside the index's directory");
    }
    let normal: Vec<&str> = parts.iter().filter_map(|c| c.as_os_str().to_str()).collect();
    Ok(normal.join("/"))
}

/// Each tensor's position in `tables` (each shard's path and tensor
/// names, the shards in [`Model::shards`]' order), checked against each
/// other and the index's `weight_map` (as [`Model::weight_map`] holds it):
/// a tensor in two shards, one the map puts in a shard that lacks it, and
/// one the map does not list are [`Error::Model`] errors naming the tensor
/// and the shards. Python's `dmaload.safetensors` checks its shards with
/// this too.
pub fn tensor_index<S: AsRef<str>>(
    tables: &[(String, Vec<S>)],
    weight_map: Option<&[(String, String)]>,
) -> Result<BTreeMap<String, usize>, Error> {
    let mut index = BTreeMap::new();
    for (i, (path, names)) in tables.iter().enumerate() {
        for name in names.iter().map(AsRef::as_ref) {
            if let Some(&first) = index.get(name) {
                let first: usize = first;
                return Err(Error::Model(format!(
                    "tensor {} is in both {} and {path}",
                    py_repr(name),
                    tables[first].0
                )));
            }
            index.insert(name.to_owned(), i);
        }
    }
    let Some(weight_map) = weight_map else { return Ok(index) };
    // The shards are in the order of their first mention in the map.
    let mut position = HashMap::new();
    for (_, shard) in weight_map {
        let next = position.len();
        position.entry(shard.as_str()).or_insert(next);
    }
    for (name, shard) in weight_map {
        let i = position[shard.as_str()];
        let owner = index.get(name).copied();
        if owner != Some(i) {
            let r#where = match owner {
                Some(o) => format!("it is in {}", tables[o].0),
                None => "no shard has it".into(),
            };
            return Err(Error::Model(format!(
                "index says tensor {} is in {}, but that file has no such tensor ({where})",
                py_repr(name),
                tables[i].0
            )));
        }
    }
    let listed: std::collections::HashSet<&str> = weight_map.iter().map(|(n, _)| n.as_str()).collect();
    let unlisted: Vec<&String> = index.keys().filter(|n| !listed.contains(n.as_str())).collect();
    if let Some(first) = unlisted.first() {
        return Err(Error::Model(format!(
            "tensor {} is in {} but the index's weight_map does not list it ({} such tensor(s))",
            py_repr(first),
            tables[index[*first]].0,
            unlisted.len()
        )));
    }
    Ok(index)
}

/// `f` of the object at `url` if it exists, `None` if it does not (HTTP
/// 404); any other failure is the error.
fn object_if_exists<T>(
    url: &str,
    cancel: &CancelToken,
    f: impl FnOnce(&Object) -> Result<T, Error>,
) -> Result<Option<T>, Error> {
    match Object::open(url, cancel) {
        Ok(object) => f(&object).map(Some),
        Err(err) if err.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(err) => Err(err.into()),
    }
}

/// The bytes of the index at `path`: a regular file (a FIFO would block
/// for ever, a device such as `/dev/zero` never end) of at most
/// [`MAX_INDEX_LEN`] bytes.
fn read_index(path: &Path) -> Result<Vec<u8>, Error> {
    let file = crate::sys::file::open_nonblocking(path).map_err(|e| IoError::io("read index", path, e))?;
    let meta = file.metadata().map_err(|e| IoError::io("read index", path, e))?;
    if !meta.file_type().is_file() {
        return Err(IoError::with_errno("read index", path, libc::EINVAL, "not a regular file").into());
    }
    let mut data = Vec::new();
    file.take(MAX_INDEX_LEN + 1).read_to_end(&mut data).map_err(|e| IoError::io("read index", path, e))?;
    if data.len() as u64 > MAX_INDEX_LEN {
        return Err(Error::Model(format!(
            "{}: the index exceeds the limit of {MAX_INDEX_LEN} bytes",
            path.display()
        )));
    }
    Ok(data)
}

/// `s` quoted as Python's `repr` quotes a `str`, so that messages read the
/// same from Rust and from Python.
pub fn py_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..0xa0).contains(&(c as u32)) => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// An index file: its `weight_map` when that is an object of strings
/// (`None` otherwise); every other key is skipped. A key given twice in
/// any object of the file is an error (serde would keep the last).
struct IndexJson {
    weight_map: Option<Vec<(String, String)>>,
}

impl<'de> Deserialize<'de> for IndexJson {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = deserializer.deserialize_any(Strict)?;
        let weight_map = match value {
            Json::Object(entries) => {
                entries.into_iter().find(|(k, _)| k == "weight_map").and_then(|(_, v)| match v {
                    Json::Object(map) => map
                        .into_iter()
                        .map(|(k, v)| match v {
                            Json::String(s) => Some((k, s)),
                            _ => None,
                        })
                        .collect(),
                    _ => None,
                })
            }
            _ => None,
        };
        Ok(IndexJson { weight_map })
    }
}

/// A JSON value as far as an index needs it: objects (in order) and
/// strings kept, everything else only checked.
enum Json {
    Object(Vec<(String, Json)>),
    String(String),
    Other,
}

/// Reads any JSON value into [`Json`], refusing a key given twice in one
/// object.
struct Strict;

impl<'de> de::DeserializeSeed<'de> for Strict {
    type Value = Json;
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Json, D::Error> {
        deserializer.deserialize_any(Strict)
    }
}

impl<'de> Visitor<'de> for Strict {
    type Value = Json;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut entries: Vec<(String, Json)> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(de::Error::custom(format!(
                    "key {} appears twice in the same JSON object",
                    py_repr(&key)
                )));
            }
            let value = map.next_value_seed(Strict)?;
            entries.push((key, value));
        }
        Ok(Json::Object(entries))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        while seq.next_element_seed(Strict)?.is_some() {}
        Ok(Json::Other)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Json, E> {
        Ok(Json::String(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Json, E> {
        Ok(Json::String(v))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Json, E> {
        Ok(Json::Other)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Json, E> {
        Ok(Json::Other)
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Json, E> {
        Ok(Json::Other)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Json, E> {
        Ok(Json::Other)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Json, E> {
        Ok(Json::Other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names_are_normalized_or_refused_as_python_does() {
        assert_eq!(shard_key("./a.safetensors").as_deref(), Ok("a.safetensors"));
        assert_eq!(shard_key("sub//b.safetensors/").as_deref(), Ok("sub/b.safetensors"));
        for bad in ["", ".", "..", "a/..", "a\0b"] {
            assert_eq!(shard_key(bad), Err(", which is not a file name"), "{bad:?}");
        }
        for outside in ["/abs.safetensors", "../x.safetensors", "sub/../../x.safetensors"] {
            assert_eq!(shard_key(outside), Err(", which is outside the index's directory"), "{outside:?}");
        }
    }

    #[test]
    fn names_are_quoted_as_python_repr_quotes_them() {
        assert_eq!(py_repr("layer0.q"), "'layer0.q'");
        assert_eq!(py_repr("a\0b"), "'a\\x00b'");
        assert_eq!(py_repr("it's"), "\"it's\"");
        assert_eq!(py_repr("'\""), "'\\'\"'");
    }

    #[test]
    fn a_key_twice_anywhere_in_the_index_is_refused() {
        let twice = br#"{"metadata": {"a": 1, "a": 2}, "weight_map": {"t": "x"}}"#;
        let err = serde_json::from_slice::<IndexJson>(twice).err().expect("refused");
        assert!(err.to_string().contains("appears twice"), "{err}");
        let ok: IndexJson =
            serde_json::from_slice(br#"{"weight_map": {"t": "x"}, "n": [1, {"a": null}]}"#).unwrap();
        assert_eq!(ok.weight_map, Some(vec![("t".into(), "x".into())]));
        let not_strings: IndexJson = serde_json::from_slice(br#"{"weight_map": {"t": 1}}"#).unwrap();
        assert_eq!(not_strings.weight_map, None);
    }
}
