//! The store's stock authority and the beats of the instances that sell under it (see
//! [`crate::authority`] for the rules they keep).

use sqlx::Row;

use super::{Db, DbError};

/// The stock authority a store records (see [`crate::authority`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthorityRecord {
    /// The authority's id, also kept in its Redis.
    pub id: String,
    /// Where it is, for people: the Redis URL without credentials, or the embedded
    /// mode's data directory.
    pub location: String,
    /// Since when, Unix ms.
    pub since_ms: i64,
    /// Whether its last instance stopped gracefully with every order stored, so that a
    /// take-over may move the store.
    pub released: bool,
}

impl Db {
    /// The stock authority this store records; `None` until the store is first used.
    pub async fn authority(&self) -> Result<Option<AuthorityRecord>, DbError> {
        let row = sqlx::query(
            "SELECT authority, authority_location, authority_since, authority_released \
             FROM store WHERE id = 1",
        )
        .fetch_one(&self.pool)
        .await?;
        let id: Option<String> = row.try_get("authority")?;
        Ok(match id {
            Some(id) => Some(AuthorityRecord {
                id,
                location: row
                    .try_get::<Option<String>, _>("authority_location")?
                    .unwrap_or_default(),
                since_ms: row
                    .try_get::<Option<i64>, _>("authority_since")?
                    .unwrap_or_default(),
                released: row.try_get::<i32, _>("authority_released")? != 0,
            }),
            None => None,
        })
    }

    /// Records `record` as the store's first authority, unless one is recorded already.
    /// Returns the authority recorded afterwards: another instance's when it was first.
    pub async fn record_first_authority(
        &self,
        record: &AuthorityRecord,
    ) -> Result<AuthorityRecord, DbError> {
        self.set_authority(record, "authority IS NULL").await?;
        self.authority().await?.ok_or_else(|| {
            DbError::Query(sqlx::Error::Protocol(
                "the store's authority is unset right after it was recorded".into(),
            ))
        })
    }

    /// Records `record` as the store's authority, released (no instance of it sells yet),
    /// if the current one is released or `abandon` says to take it regardless. One
    /// statement, so of two take-overs at once only one succeeds. Returns whether this
    /// one did.
    pub async fn take_over_authority(
        &self,
        record: &AuthorityRecord,
        abandon: bool,
    ) -> Result<bool, DbError> {
        let condition = if abandon {
            "1 = 1"
        } else {
            "(authority IS NULL OR authority_released = 1)"
        };
        Ok(self.set_authority(record, condition).await? == 1)
    }

    async fn set_authority(
        &self,
        record: &AuthorityRecord,
        condition: &str,
    ) -> Result<u64, DbError> {
        Ok(sqlx::query(&format!(
            "UPDATE store SET authority = $1, authority_location = $2, authority_since = $3, \
             authority_released = $4 WHERE id = 1 AND {condition}"
        ))
        .bind(record.id.as_str())
        .bind(record.location.as_str())
        .bind(record.since_ms)
        .bind(i32::from(record.released))
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    /// Marks authority `id` in use (not released) if the store still records it; `false`
    /// when another took the store over meanwhile.
    pub async fn occupy_authority(&self, id: &str) -> Result<bool, DbError> {
        self.mark_released(id, false).await
    }

    /// Marks authority `id` released, if the store still records it.
    pub async fn release_authority(&self, id: &str) -> Result<bool, DbError> {
        self.mark_released(id, true).await
    }

    async fn mark_released(&self, id: &str, released: bool) -> Result<bool, DbError> {
        let changed =
            sqlx::query("UPDATE store SET authority_released = $1 WHERE id = 1 AND authority = $2")
                .bind(i32::from(released))
                .bind(id)
                .execute(&self.pool)
                .await?
                .rows_affected();
        Ok(changed == 1)
    }
}

/// An instance that sells a store's stock, as its last beat recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveInstance {
    /// Host and process, for people.
    pub described: String,
    /// The authority it sells under.
    pub authority: String,
    /// Its last beat, Unix ms.
    pub seen_ms: i64,
}

impl Db {
    /// Records that instance `id` (`described` for people) sells under `authority` now,
    /// and returns whether the store still records that authority.
    pub async fn beat(
        &self,
        id: &str,
        described: &str,
        authority: &str,
        now_ms: i64,
    ) -> Result<bool, DbError> {
        sqlx::query(
            "INSERT INTO store_instances (id, described, authority, seen_at) \
             VALUES ($1, $2, $3, $4) \
             ON CONFLICT (id) DO UPDATE SET seen_at = excluded.seen_at",
        )
        .bind(id)
        .bind(described)
        .bind(authority)
        .bind(now_ms)
        .execute(&self.pool)
        .await?;
        Ok(self
            .authority()
            .await?
            .is_some_and(|record| record.id == authority))
    }

    /// Removes instance `id`: it stopped selling.
    pub async fn leave(&self, id: &str) -> Result<(), DbError> {
        sqlx::query("DELETE FROM store_instances WHERE id = $1")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The instances that beat after `since_ms`, most recent first. Rows of instances
    /// silent for an hour (killed) are removed on the way.
    pub async fn live_instances(
        &self,
        since_ms: i64,
        now_ms: i64,
    ) -> Result<Vec<LiveInstance>, DbError> {
        sqlx::query("DELETE FROM store_instances WHERE seen_at < $1")
            .bind(now_ms.saturating_sub(3_600_000))
            .execute(&self.pool)
            .await?;
        let rows = sqlx::query(
            "SELECT described, authority, seen_at FROM store_instances \
             WHERE seen_at > $1 ORDER BY seen_at DESC",
        )
        .bind(since_ms)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(LiveInstance {
                    described: row.try_get("described")?,
                    authority: row.try_get("authority")?,
                    seen_ms: row.try_get("seen_at")?,
                })
            })
            .collect()
    }
}
